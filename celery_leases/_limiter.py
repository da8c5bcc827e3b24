"""The sync side of rate limits: ``Leases.limit`` with its wait, and a task's admission taken
all or nothing with its leases."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery.utils.log import get_logger

from . import _limits, signals
from ._lease import Held, Lease, Want
from ._limits import Admitted, LimitWant, Rate, admit, want
from .exceptions import LeaseBackendError, LeaseConfigError, RateLimited

if TYPE_CHECKING:
    from ._sync.driver import LeaseStore
    from .app import Leases

__all__ = ("Taker", "check_rates", "limit", "limit_wants", "penalize", "set_rate", "take")

logger = get_logger(__name__)

#: the metrics label of a limit checked outside a task (``leases.limit``): a rendered name
#: is never a label, so 10,000 keys add no series
NO_TEMPLATE = "-"


class Taker(Protocol):
    """Who takes a task's leases and gives them back: the app's :class:`Leases` (as this
    process's owner), or a test's simulated process with its faults (tests/integration/
    test_model.py). Its ``store`` carries the limits that ride with the grant."""

    @property
    def store(self) -> LeaseStore: ...

    def acquire(
        self,
        wants: Sequence[Want],
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
        task_id: str | None = None,
        on_lost: Callable[[Held], None] | None = None,
    ) -> list[Lease]: ...

    def release(self, leases: Sequence[Lease]) -> list[Lease]: ...


class _Rendering(Protocol):
    def render(self, task_name: str, bound: Mapping[str, Any]) -> Want: ...


class _LimitedTask(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def _rate_templates(self) -> Sequence[tuple[Rate, _Rendering]]: ...


def check_rates(task_name: str, rate: object, rates: object) -> list[Rate]:
    """A task's ``rate=`` / ``rates=`` as a list of :class:`Rate`, checked at declaration."""
    if rate is not None and rates is not None:
        msg = f"task {task_name!r}: give either rate= or rates=, not both"
        raise LeaseConfigError(msg)
    if rate is not None:
        items: list[object] = [rate]
    elif rates is None:
        return []
    elif isinstance(rates, (str, Rate)) or not isinstance(rates, Sequence) or not rates:
        msg = f"task {task_name!r}: rates= must be a non-empty list of Rate(...), not {rates!r}"
        raise LeaseConfigError(msg)
    else:
        items = list(rates)
    for item in items:
        if not isinstance(item, Rate):
            msg = f"task {task_name!r}: a rate must be a Rate(template, 'N/s'), not {item!r}"
            raise LeaseConfigError(msg)
    return items  # type: ignore[return-value]


def _sent(admitted: Sequence[Admitted], wants: Sequence[LimitWant], task_id: str | None) -> None:
    for a, w in zip(admitted, wants, strict=True):
        signals.limit_admitted.send(
            sender=w.template or NO_TEMPLATE,
            name=a.name,
            cost=w.cost,
            at=a.at_us / 1e6,
            task_id=task_id,
        )


def _refused(limited: RateLimited, wants: Sequence[LimitWant], task_id: str | None) -> None:
    template = next((w.template for w in wants if w.name == limited.resource), "")
    signals.limit_refused.send(
        sender=template or NO_TEMPLATE,
        name=limited.resource,
        retry_after=limited.retry_after,
        task_id=task_id,
    )


def limit(ext: Leases, name: str, rate: str, cost: int, wait: float | None) -> None:
    """See :meth:`Leases.limit`: admitted, or RateLimited once the wait cannot help."""
    from .app import check_wait  # app imports this module

    check_wait(wait)
    wants = [want(name, rate, cost)]
    store = ext.store
    started = time.monotonic()
    while True:
        try:
            admitted = store.run(admit(store.engine, wants))
        except RateLimited as limited:
            _refused(limited, wants, None)
            waited = time.monotonic() - started if wait else 0.0
            if wait is not None and waited + limited.retry_after > wait:
                raise RateLimited(name, limited.retry_after, waited) from None
            time.sleep(limited.retry_after)
            continue
        _sent(admitted, wants, None)
        return


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise LeaseConfigError(f"{what} needs a limit name, not {name!r}")


def set_rate(store: LeaseStore, name: str, rate: str | None) -> None:
    """See :meth:`Leases.set_rate`."""
    _check_name("set_rate", name)
    store.run(_limits.set_rate(store.engine, name, rate))


def penalize(store: LeaseStore, name: str, retry_after: object) -> float:
    """See :meth:`Leases.penalize`."""
    _check_name("penalize", name)
    ok = isinstance(retry_after, (int, float)) and not isinstance(retry_after, bool)
    if not ok or not 0 < retry_after <= 86400:  # type: ignore[operator]
        msg = f"penalize: retry_after must be seconds from 0 to 86400, not {retry_after!r}"
        raise LeaseConfigError(msg)
    return store.run(_limits.penalize(store.engine, name, float(retry_after)))  # type: ignore[arg-type]


def limit_wants(task: _LimitedTask, bound: Mapping[str, Any]) -> list[LimitWant]:
    """The task's rate limits, rendered for the call's arguments ``bound``."""
    return [
        LimitWant(t.render(task.name, bound).resource, r.n, int(r.period * 1e6), r.cost, r.template)
        for r, t in task._rate_templates
    ]


def take(
    taker: Taker,
    limits: list[LimitWant],
    wants: list[Want],
    ttl: float | None,
    wait: float | None,
    task_id: str | None,
    on_lost: Callable[[Held], None] | None,
) -> list[Lease]:
    """A task's leases (``wants``, for ``ttl``) and its rate limits (``limits``, rendered
    by :func:`limit_wants`), all or nothing.

    Without a wait, the limit checks ride in the round trip of the grant (``riding``): one
    round trip for both. A busy lease then takes back the admissions made (a refund, the
    next round trip); a refused limit gives the leases back at once. With a wait
    (``on_busy="wait"``) the limits are checked after the leases are held, so the lease wait
    does not stand between an admission and the body; a refusal sleeps exactly the
    limiter's ``retry_after`` and tries again while the wait lasts.

    Raises:
        LeaseBusy: a lease stayed busy (no admission kept).
        RateLimited: a limit refused (no lease kept); ``retry_after`` is its exact wait.
    """
    store = taker.store
    started = time.monotonic()
    while True:
        left = None if wait is None else max(0.0, wait - (time.monotonic() - started))
        leases: list[Lease] = []
        try:
            if wants and wait is not None and wait <= 0:
                leases, admitted = _ride(taker, wants, limits, ttl, task_id, on_lost)
            else:
                if wants:
                    leases = taker.acquire(
                        wants, ttl=ttl, wait=left, task_id=task_id, on_lost=on_lost
                    )
                admitted = store.run(admit(store.engine, limits))
        except RateLimited as limited:
            taker.release(leases)
            _refused(limited, limits, task_id)
            waited = time.monotonic() - started if wait else 0.0
            if wait is None or waited + limited.retry_after <= wait:
                time.sleep(limited.retry_after)
                continue
            if waited > 0:
                raise RateLimited(limited.resource, limited.retry_after, waited) from None
            raise
        except BaseException:
            taker.release(leases)
            raise
        _sent(admitted, limits, task_id)
        return leases


def _ride(
    taker: Taker,
    wants: list[Want],
    limits: list[LimitWant],
    ttl: float | None,
    task_id: str | None,
    on_lost: Callable[[Held], None] | None,
) -> tuple[list[Lease], list[Admitted]]:
    """The leases and the limits in one round trip (see :func:`take`). A refusal raises
    with the leases given back; a busy lease raises with the admissions taken back."""
    store = taker.store
    engine = store.engine
    with store.riding(_limits.checks(engine, limits)) as ride:
        try:
            leases = taker.acquire(wants, ttl=ttl, wait=0.0, task_id=task_id, on_lost=on_lost)
        except BaseException:
            made = _limits.admitted_in(limits, ride.replies) if ride.replies else []
            if made:
                try:
                    store.run(_limits.refund(engine, made))
                except LeaseBackendError as exc:  # counted until it leaves the window
                    logger.error("leases: could not refund %d admission(s): %s", len(made), exc)
            raise
    try:
        if ride.replies is None:  # the grant went without it (or its round trip failed)
            return leases, store.run(admit(engine, limits))
        return leases, store.run(_limits.settle(engine, limits, ride.replies))
    except BaseException:
        taker.release(leases)
        raise
