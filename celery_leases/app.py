"""Leases(app): the object a project creates once, next to its Celery app.

Example::

    from celery import Celery
    from celery_leases import Leases, Shared

    app = Celery("proj", broker="redis://localhost:6379/0")
    leases = Leases(app, ttl=30)

    with leases.hold("report:42", wait=10) as lease:     # renewed while inside
        write(report, fence=lease.token)

    with leases.hold(["repo:7", Shared("remote:3")], wait=5) as (repo, remote):
        ...                                               # all or nothing
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
)
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast, overload

from celery.utils.log import get_logger

from . import _limiter
from . import once as _once
from ._aio.driver import AsyncLeaseStore
from ._aio.heartbeat import loop_heartbeat
from ._aio.shields import shielded
from ._engine import LeaseEngine
from ._identity import Identity, current_identity
from ._lease import Held, Lease, LeaseArgumentError, Shared, Want, held_of, want_of
from ._outcomes import (
    busy_seen,
    granted_leases,
    held_here,
    raise_first_lost,
    released_leases,
    same_owner_busy,
    to_release,
)
from ._parking import ahand_on_released, hand_on_released, parks
from ._revocation import Revoked, check_revoke
from ._sync.driver import LeaseStore
from ._sync.heartbeat import heartbeat
from ._unique import install as install_unique
from .config import AppSettings, LeaseSettings, safe_url, set_settings
from .exceptions import LeaseBackendError, LeaseBusy, LeaseConfigError
from .worker import install

if TYPE_CHECKING:
    from celery import Celery

__all__ = ("Leases",)

logger = get_logger(__name__)

T = TypeVar("T")

Resource = str | Shared


class Leases:
    """The celery_leases extension of one Celery app.

    Args:
        app: the Celery app. Its ``leases_*`` config keys are read as settings.
        **settings: settings that win over ``app.conf`` and the environment (see
            :class:`~celery_leases.config.LeaseSettings`).

    Raises:
        LeaseConfigError: a setting is invalid; the message names it and where it came from.

    .. versionadded:: 0.1
    """

    def __init__(self, app: Celery, **settings: Any) -> None:
        existing = find_leases(app)
        if existing is not None:
            msg = (
                f"app {app.main!r} already has Leases(app) ({existing!r}); create it once, next "
                "to the app, and import that one (app.leases is it). A second one would take "
                "over the app's settings and signals from the first"
            )
            raise LeaseConfigError(msg)
        self.app = app
        # resolved now (an invalid value fails here) and again at first use (Celery reads its
        # config lazily: a key set after Leases(app) still counts), then fixed
        self._settings = AppSettings(app, settings)
        set_settings(app, self._settings)
        # each driver is made at first use, on the one engine of the settings in force
        self._lock = threading.Lock()
        self._engine = LeaseEngine(self._settings.peek())
        self._store: LeaseStore | None = None
        self._astore: AsyncLeaseStore | None = None
        self._parking: bool | None = None  # a task defers (on_busy="defer"): see release
        if self._engine.cluster:
            # a cluster client reads the slot map as it is made: an unreachable cluster is an
            # error here, as a bad URL is (the settings' checks found that one already)
            self._store_for(self._engine.settings)
        # task.py imports this module (LeasedTask needs Leases): imported here, not at the top
        from .task import adopt_tasks

        # first, so that a task refused here leaves the app without a half-made Leases
        adopt_tasks(app)
        app.leases = self  # type: ignore[attr-defined]
        install(self)
        install_unique(self)

    @property
    def settings(self) -> LeaseSettings:
        """The settings in force (resolved at first use, then fixed; see the configuration docs).

        Reading them is not a use: before the first lease they are resolved from the config
        as it is now, and a key set afterwards still counts.

        .. versionadded:: 0.1
        """
        return self._settings.view()

    @property
    def store(self) -> LeaseStore:
        """The Redis store, on the settings in force (see :attr:`settings`)."""
        return self._store_for(self._settings.current())

    def _store_for(self, settings: LeaseSettings) -> LeaseStore:
        """The store of ``settings`` (the settings in force, read by the caller)."""
        store = self._store
        if store is None or store.settings is not settings:
            with self._lock:
                store = self._store
                if store is None or store.settings is not settings:
                    if store is not None:
                        # first use found settings made after Leases(app): nothing used the
                        # old store
                        store.close()
                    store = self._store = LeaseStore(settings, engine=self._engine_of(settings))
        return store

    def _engine_of(self, settings: LeaseSettings) -> LeaseEngine:
        """The engine of ``settings``, shared by both drivers (the caller holds the lock)."""
        if self._engine.settings is not settings:
            self._engine = LeaseEngine(settings)
        return self._engine

    def _check_settings(self, *, full: bool = False) -> LeaseSettings:
        """The settings, refusing a ``leases_*`` key changed since their first use."""
        return self._settings.check(full=full)

    def __repr__(self) -> str:
        s = self._settings.peek()
        return f"<Leases {self.app.main!r} at {safe_url(s.url)} prefix={s.key_prefix!r}>"

    # --- identity -----------------------------------------------------------------------
    def identity(self) -> Identity:
        """The owner identity of the calling process."""
        return current_identity(self.settings.node)

    def _ttl(self, ttl: float | None) -> float:
        if ttl is None:
            return self.settings.ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0.05 <= ttl <= 86400:
            msg = f"ttl must be a number of seconds from 0.05 to 86400, not {ttl!r}"
            raise LeaseConfigError(msg)
        return float(ttl)

    # --- hold ---------------------------------------------------------------------------
    @overload
    def hold(
        self, resource: Resource, *, ttl: float | None = ..., wait: float | None = ...
    ) -> AbstractContextManager[Lease]: ...
    @overload
    def hold(
        self,
        resource: list[Resource] | tuple[Resource, ...],
        *,
        ttl: float | None = ...,
        wait: float | None = ...,
    ) -> AbstractContextManager[list[Lease]]: ...

    def hold(
        self,
        resource: Resource | list[Resource] | tuple[Resource, ...],
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
    ) -> AbstractContextManager[Lease] | AbstractContextManager[list[Lease]]:
        """Hold a lease (or several, all or nothing) while inside the ``with`` block.

        Args:
            resource: a name, a :class:`Shared`, or a list of them.
            ttl: seconds the lease lives without renewal (default: the ``ttl`` setting). The
                heartbeat renews it every ``ttl / 3`` while the block runs.
            wait: seconds to wait for a busy resource; 0 tries once, None waits without limit.
                A waiter is woken by the release, not by polling.

        Yields:
            a :class:`Lease`, or a list of them in the order given.

        Raises:
            LeaseBusy: still busy when the wait ended; ``.resource`` names the first busy one.
            LeaseLost: on leaving the block, if a lease was lost while inside (unless the
                block itself raised).
            LeaseBackendError: Redis failed.
        """
        check_wait(wait)
        if isinstance(resource, (str, Shared)):
            return _Holding(self, [resource], ttl, wait, one=True)
        return _Holding(self, _resource_list("hold", resource), ttl, wait, one=False)

    # --- once ---------------------------------------------------------------------------
    def once(
        self,
        name: str,
        fn: Callable[[], object],
        *,
        ttl: float | None = None,
        wait: float | None = None,
        receipt_ttl: float | None = None,
    ) -> Any:
        """Run ``fn`` in exactly one caller at a time across the fleet; return its receipt.

        The first caller runs ``fn`` under an exclusive lease and stores its JSON-serialisable
        return value as the receipt of ``name``; every other caller waits (woken by the
        release) and gets that receipt. See :mod:`celery_leases.once`.

        Args:
            name: the receipt's name, e.g. ``"analysis:42:input"``.
            fn: the initializer, called without arguments.
            ttl: the initializer's lease TTL (renewed while ``fn`` runs).
            wait: seconds to wait for another initializer; None waits without limit.
            receipt_ttl: seconds to keep the receipt (default: the ``receipt_ttl`` setting).

        Raises:
            LeaseBusy: still initialised by another caller when ``wait`` ran out.
            LeaseLost: the lease was lost while ``fn`` ran; nothing was stored.
            TypeError: the return value is not JSON-serialisable; nothing was stored.
        """
        return _once.once(self, name, fn, ttl=ttl, wait=wait, receipt_ttl=receipt_ttl)

    def receipt(self, name: str, default: Any = None) -> Any:
        """The receipt of ``once(name, ...)``, or ``default`` when there is none.

        Args:
            name: the receipt's name.
            default: returned when there is no receipt (None). A receipt can itself be None
                (an initializer that returned None): pass a sentinel of your own, e.g.
                ``leases.receipt(name, default=MISSING) is MISSING``, to tell the two apart.
        """
        return _once.receipt(self, name, default)

    def forget(self, name: str) -> bool:
        """Delete the receipt of ``once(name, ...)`` (the next ``once`` runs again)."""
        return _once.forget(self, name)

    def limit(self, name: str, rate: str, *, cost: int = 1, wait: float | None = 0.0) -> None:
        """Return once limit ``name`` (``rate`` "N/s|m|h": N by cost in any window, fleet-wide)
        admits ``cost``; ``wait`` 0: once, None: no limit; else :class:`RateLimited`.

        .. versionadded:: 0.2"""
        _limiter.limit(self, name, rate, cost, wait)

    def set_rate(self, name: str, rate: str | None) -> None:
        """Override the rate of the limit ``name`` fleet-wide, at once; None removes it.

        .. versionadded:: 0.2"""
        _limiter.set_rate(self.store, name, rate)

    def penalize(self, name: str, *, retry_after: float) -> float:
        """Admit nobody under the limit ``name`` for ``retry_after`` s; returns how long it lasts.

        .. versionadded:: 0.2"""
        return _limiter.penalize(self.store, name, retry_after)

    def revoke(self, resource: str, *, reason: str = "", deadline: float | None = None) -> Revoked:
        """Ask the holders of ``resource`` to let go: each learns at its next renewal
        (:class:`LeaseRevoked`, raised as its ``on_lost`` says and by ``check()``), and
        Redis lets the lease run out ``deadline`` s from now (None: the ``ttl`` setting)
        unless released first; the next holder gets a new token. See :class:`Revoked`.

        .. versionadded:: 0.2"""
        return _revoke(self, resource, reason, deadline)

    # --- the shared acquire / release path (hold, tasks, once) ---------------------------
    def acquire(
        self,
        wants: Sequence[Want],
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
        task_id: str | None = None,
        on_lost: Callable[[Held], None] | None = None,
    ) -> list[Lease]:
        """Acquire ``wants`` all or nothing and start renewing them; see :meth:`hold`."""
        settings = self._check_settings()
        ttl = self._ttl(ttl)
        check_wait(wait)
        ident = current_identity(settings.node)
        store = self._store_for(settings)
        started = time.monotonic()
        try:
            granted = store.acquire(wants, ident, ttl, wait, task_id)
        except LeaseBusy as busy:
            busy_seen(busy, wants, ttl, task_id, time.monotonic() - started)
            if held_here(busy, wants, ident, store, heartbeat().snapshot()):
                raise same_owner_busy(busy) from None
            raise
        beat = heartbeat()
        for held in granted:
            beat.add(held, store)
        return granted_leases(granted, ttl, task_id, on_lost, time.monotonic() - started)

    def release(self, leases: Sequence[Lease]) -> list[Lease]:
        """Stop renewing ``leases`` and give them back; returns those found lost.

        Never raises for Redis trouble: a lease that cannot be given back is logged and runs
        out by its TTL (and the owner registry lets a cleanup pass free it sooner).
        """
        beat = heartbeat()
        todo, lost, asked = to_release(leases, beat.discard)
        if not todo:
            return lost
        try:
            freed = self.store.release([held_of(lease) for lease in todo])
        except LeaseBackendError as exc:
            logger.error("leases: could not release %d lease(s): %s", len(todo), exc)
            return lost
        if parks(self):  # on_busy="defer": hand on to a parked task (_parking.py)
            hand_on_released(self, [lease.resource for lease in todo])
        return released_leases(todo, freed, lost, asked)

    # --- asyncio --------------------------------------------------------------------------
    @property
    def astore(self) -> AsyncLeaseStore:
        """The asyncio store, made on first use (it shares :attr:`store`'s engine)."""
        astore = self._astore
        if astore is None:
            settings = self._settings.current()
            with self._lock:
                astore = self._astore
                if astore is None:
                    engine = self._engine_of(settings)
                    astore = self._astore = AsyncLeaseStore(settings, engine=engine)
        return astore

    @overload
    def ahold(
        self, resource: Resource, *, ttl: float | None = ..., wait: float | None = ...
    ) -> AbstractAsyncContextManager[Lease]: ...
    @overload
    def ahold(
        self,
        resource: list[Resource] | tuple[Resource, ...],
        *,
        ttl: float | None = ...,
        wait: float | None = ...,
    ) -> AbstractAsyncContextManager[list[Lease]]: ...

    def ahold(
        self,
        resource: Resource | list[Resource] | tuple[Resource, ...],
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
    ) -> AbstractAsyncContextManager[Lease] | AbstractAsyncContextManager[list[Lease]]:
        """:meth:`hold` for asyncio: ``async with leases.ahold("report:42", wait=10) as lease:``.

        The same leases, tokens and errors as :meth:`hold` (a sync and an async holder of one
        resource exclude each other), on redis-py's asyncio client. The leases are renewed by
        one task per event loop; a waiter is woken by the release through one subscriber
        connection per loop. A cancelled waiter leaves nothing behind, and a cancelled holder
        releases its leases on the way out.

        Raises:
            LeaseBusy: still busy when the wait ended; ``.resource`` names the first busy one.
            LeaseLost: on leaving the block, if a lease was lost while inside (unless the
                block itself raised).
            LeaseBackendError: Redis failed.

        .. versionadded:: 0.1
        """
        check_wait(wait)
        if isinstance(resource, (str, Shared)):
            return _AHold[Lease](self, [resource], ttl, wait, one=True)
        return _AHold[list[Lease]](self, _resource_list("ahold", resource), ttl, wait, one=False)

    async def aonce(
        self,
        name: str,
        fn: Callable[[], object],
        *,
        ttl: float | None = None,
        wait: float | None = None,
        receipt_ttl: float | None = None,
    ) -> Any:
        """:meth:`once` for asyncio: ``receipt = await leases.aonce(name, fn, wait=600)``.

        ``fn`` may be a coroutine function (awaited on the loop) or a plain function (run in
        a worker thread, so it cannot stall the loop or the heartbeat that renews its lease).
        The same receipts, keys and lease as :meth:`once`: sync and async callers of one
        name run the initializer once between them. See :mod:`celery_leases.once`.

        .. versionadded:: 0.1
        """
        return await _once.aonce(self, name, fn, ttl=ttl, wait=wait, receipt_ttl=receipt_ttl)

    async def areceipt(self, name: str, default: Any = None) -> Any:
        """:meth:`receipt` for asyncio (``default`` as there).

        .. versionadded:: 0.1
        """
        return await _once.areceipt(self, name, default)

    async def aforget(self, name: str) -> bool:
        """:meth:`forget` for asyncio.

        .. versionadded:: 0.1
        """
        return await _once.aforget(self, name)

    async def aclose(self) -> None:
        """Close the running event loop's Redis connections (call it when the loop ends).

        An ASGI app calls it at shutdown (e.g. in its lifespan); new connections are made
        if it is used again.

        .. versionadded:: 0.1
        """
        if self._astore is not None:
            await self._astore.aclose()

    async def aacquire(
        self,
        wants: Sequence[Want],
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
    ) -> list[Lease]:
        """:meth:`acquire` for asyncio: renewed by the running loop's heartbeat."""
        return await _aacquire(self, wants, ttl, wait)

    async def arelease(self, leases: Sequence[Lease]) -> list[Lease]:
        """:meth:`release` for asyncio; never raises for Redis trouble."""
        todo, lost, asked = to_release(leases, loop_heartbeat().discard)
        if not todo:
            return lost
        try:
            freed = await self.astore.release([held_of(lease) for lease in todo])
        except LeaseBackendError as exc:
            logger.error("leases: could not release %d lease(s): %s", len(todo), exc)
            return lost
        if parks(self):  # as release does
            await ahand_on_released(self, [lease.resource for lease in todo])
        return released_leases(todo, freed, lost, asked)


async def _aacquire(
    ext: Leases, wants: Sequence[Want], ttl: float | None, wait: float | None
) -> list[Lease]:
    """:meth:`Leases.aacquire` (out of the class, which is at its size cap)."""
    ext._check_settings()
    ttl = ext._ttl(ttl)
    check_wait(wait)
    ident = ext.identity()
    started = time.monotonic()
    astore = ext.astore
    try:
        granted = await astore.acquire(wants, ident, ttl, wait)
    except LeaseBusy as busy:
        busy_seen(busy, wants, ttl, None, time.monotonic() - started)
        mine = [*loop_heartbeat().snapshot(), *heartbeat().snapshot()]
        if held_here(busy, wants, ident, ext.store, mine):
            raise same_owner_busy(busy) from None
        raise
    beat = loop_heartbeat()
    for held in granted:
        beat.add(held, astore)
    return granted_leases(granted, ttl, None, None, time.monotonic() - started)


def _revoke(ext: Leases, resource: str, reason: str, deadline: float | None) -> Revoked:
    """:meth:`Leases.revoke`: checked, sent, logged."""
    settings = ext._check_settings()
    deadline = settings.ttl if deadline is None else deadline
    check_revoke(resource, reason, deadline)
    done = ext.store.revoke(resource, reason, deadline)
    if done.holders:
        logger.warning(
            "leases: revoked %s held by %s (%s); it runs out in %.1fs unless released first",
            resource,
            ", ".join(done.holders),
            reason or "no reason given",
            done.deadline,
        )
    else:
        logger.info("leases: revoke %s: nobody holds it", resource)
    return done


class _Block:
    """A ``hold()`` or ``ahold()`` block: what to acquire on entry, and what it got.

    Classes rather than generator-based context managers: these are the hot paths, and the
    generator forms stepped two generators and their bookkeeping per block.
    """

    __slots__ = ("_ext", "_leases", "_one", "_resources", "_ttl", "_wait")

    def __init__(
        self,
        ext: Leases,
        resources: list[Resource],
        ttl: float | None,
        wait: float | None,
        *,
        one: bool,
    ) -> None:
        self._ext = ext
        self._resources = resources
        self._ttl = ttl
        self._wait = wait
        self._one = one
        self._leases: list[Lease] | None = None

    def _wants(self, what: str) -> list[Want]:
        """The block's Wants, on its (only) entry; errors name ``what`` (hold or ahold)."""
        if self._leases is not None:
            raise RuntimeError(f"this {what}() block was entered already: enter it once")
        if not self._resources:
            raise LeaseConfigError(f"{what}() needs at least one resource")
        return _wants(what, self._resources)


class _AHold(_Block, AbstractAsyncContextManager[T]):
    """What :meth:`Leases.ahold` returns: acquires on entry, releases on exit."""

    __slots__ = ()

    async def __aenter__(self) -> T:
        wants = self._wants("ahold")
        leases = self._leases = await self._ext.aacquire(wants, ttl=self._ttl, wait=self._wait)
        return cast("T", leases[0] if self._one else leases)

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        assert self._leases is not None
        # shielded: a holder cancelled again on its way out still gives its leases back
        lost = await shielded(self._ext.arelease(self._leases))
        if exc_type is None:
            raise_first_lost(lost)


def find_leases(app: object) -> Leases | None:
    """The ``Leases`` made for ``app`` (``app.leases``), or None when none was made.

    The one place that reads ``app.leases``: the task, worker, beat, CLI and unique-claim code
    all find the extension through here. Each caller decides what a missing one means (the
    worker disables its bootstep, a task or the CLI makes one from the app's settings).

    Args:
        app: a Celery app, or anything (a non-app or an app without Leases gives None).

    Returns:
        The app's ``Leases``, or None.
    """
    ext = getattr(app, "leases", None)
    return ext if isinstance(ext, Leases) else None


def checked_settings(ext: Leases, *, full: bool = False) -> LeaseSettings:
    """``ext``'s settings, refusing a ``leases_*`` key changed since their first use.

    Args:
        ext: the app's Leases.
        full: compare every key (a worker or beat start), not only the cheap ones.
    """
    return ext._check_settings(full=full)


class _Holding(_Block):
    """What :meth:`Leases.hold` returns: acquires on entry, releases on exit."""

    __slots__ = ()

    def __enter__(self) -> Any:
        wants = self._wants("hold")
        leases = self._leases = self._ext.acquire(wants, ttl=self._ttl, wait=self._wait)
        return leases[0] if self._one else leases

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        assert self._leases is not None
        lost = self._ext.release(self._leases)
        if exc_type is None:
            raise_first_lost(lost)


def close_store(ext: Leases) -> None:
    """Close ``ext``'s sync store if one was made (closing never makes one)."""
    if ext._store is not None:
        ext._store.close()


def ttl_of(ext: Leases, ttl: float | None) -> float:
    """``ttl`` checked (0.05 s to a day), or ``ext``'s default ttl when None."""
    return ext._ttl(ttl)


def check_wait(wait: object) -> None:
    """Refuse a ``wait`` that is not None, 0 or a positive number of seconds."""
    if wait is None:
        return
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        msg = f"wait must be a number of seconds or None, not {wait!r}"
        raise LeaseConfigError(msg)
    if not wait >= 0:  # also refuses NaN
        msg = f"wait must be 0 (try once), a positive number of seconds or None, not {wait!r}"
        raise LeaseConfigError(msg)


def _resource_list(what: str, resource: object) -> list[Resource]:
    """``resource`` (a list or tuple of names) as a list.

    Raises:
        LeaseArgumentError: (a TypeError and a LeaseConfigError) naming the argument.
    """
    if not isinstance(resource, (list, tuple)):
        msg = (
            f"{what}(resource): resource must be a name (str), a Shared(...) or a list of "
            f"them, not {resource!r} ({type(resource).__name__})"
        )
        raise LeaseArgumentError(msg)
    return list(resource)


#: the Want of each plain name a hold() was given (a Want is immutable; the checks of
#: want_of pass or fail by the name alone), so a name is checked once, not at every hold
_NAMED: dict[str, Want] = {}
_NAMED_SIZE: Final = 4096


def _wants(what: str, resources: Sequence[object]) -> list[Want]:
    """The Wants of a user's resources; errors name the argument (``hold(resource[1])``)."""
    if len(resources) == 1 and type(resource := resources[0]) is str:
        want = _NAMED.get(resource)
        if want is None:
            want = want_of(resource, f"{what}(resource)")
            if len(_NAMED) >= _NAMED_SIZE:
                _NAMED.clear()
            _NAMED[resource] = want
        return [want]
    return [
        want_of(r, f"{what}(resource)" if len(resources) == 1 else f"{what}(resource[{i}])")  # type: ignore[arg-type]
        for i, r in enumerate(resources)
    ]
