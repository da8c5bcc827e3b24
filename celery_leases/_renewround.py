"""One renewal round of a heartbeat, written once for the sync thread and the asyncio task.

Which leases are due, which batches go in which order with what time, what each reply
means, and what a lost lease sets off (its log line, its callbacks, the ``lease_lost``
signal). The heartbeats (``_sync/heartbeat.py``, ``_aio/heartbeat.py``) only carry the
renew calls out. No I/O.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, Generic, NamedTuple, Protocol, TypeVar

from . import signals
from .config import renewal_interval, safe_url
from .exceptions import LeaseError

if TYPE_CHECKING:
    from ._lease import Held
    from .config import LeaseSettings

__all__ = (
    "IDLE_LOOK",
    "RETRY_AFTER_FAILURE",
    "RenewCall",
    "RenewObserver",
    "RenewRound",
    "report_lost",
    "renew_observers",
    "report_revoked",
    "send_lease_lost",
    "tick_steps",
)

logger = logging.getLogger(__name__)

#: retry delay after a failed renewal (capped by the renew interval)
RETRY_AFTER_FAILURE: Final = 1.0
#: seconds between two looks of an idle heartbeat (no Redis call: it only checks its registry)
IDLE_LOOK: Final = 1.0
#: a renewal needs at least this much time before the first deadline to be worth sending
MIN_BUDGET: Final = 0.005

LostCallback = Callable[["Held"], None]
#: ``observer(seconds, ok, count)``: one renew call of ``count`` leases took ``seconds``
RenewObserver = Callable[[float, bool, int], None]

#: called after every renew call (celery_leases.metrics adds one); an observer must be cheap,
#: it runs in the heartbeat thread between two batches. Its exceptions are logged.
renew_observers: Final[list[RenewObserver]] = []


class RenewCall(NamedTuple):
    """One renew call a heartbeat round asks for (its reply: the indices Redis lost)."""

    store: Any
    owner: str
    batch: list[Held]
    budget: float


def tick_steps(
    beat: _Beat, store_of: Callable[[Held], Any], log: Any
) -> Generator[RenewCall, Any, float | None]:
    """One look of a heartbeat, written once for the thread and the asyncio task.

    Marks lost what was not confirmed in time, runs a renewal round when one is due (each
    renew call is yielded: the thread calls it, the asyncio task awaits it, and a LeaseError
    is thrown back in), and returns the seconds until something is due (None: nothing held).
    """
    now = beat.clock()
    held = beat.snapshot()
    for h in held:
        if now >= h.deadline:
            beat.lose(h, "revoked, its deadline came" if h.revoked else "not confirmed in time")
    held = [h for h in held if not h.lost]
    if not held:
        return None
    if now >= beat.next_renew:
        round_ = RenewRound(beat, held, store_of, log)
        for store, owner, batch, budget, sent in round_.batches():
            try:
                lost = yield RenewCall(store, owner, batch, budget)
            except LeaseError as exc:
                round_.failed(store, batch, sent, exc)
                continue
            round_.done(store, batch, owner, lost, sent)
        round_.finish(now)
        now = beat.clock()
        held = [h for h in held if not h.lost and not h.released]
        if not held:
            return None
    first_deadline = min(h.deadline for h in held)
    return max(0.0, min(beat.next_renew, first_deadline) - now)


class _Beat(Protocol):
    """What a :class:`RenewRound` needs of its heartbeat (the thread or the asyncio task)."""

    clock: Callable[[], float]
    #: the Redis servers (their URLs, passwords hidden) whose last renewal failed
    failing: set[str]
    next_renew: float
    renewals: int

    @property
    def lock(self) -> AbstractContextManager[Any, Any]:
        """Guards ``next_renew`` against ``add()`` in other threads."""

    def lose(self, held: Held, why: str) -> None: ...

    def snapshot(self) -> list[Held]: ...


class _Store(Protocol):
    settings: LeaseSettings


S = TypeVar("S", bound=_Store)


def _server(store: _Store) -> str:
    """The Redis server of ``store``, as its logs name it (no password)."""
    return safe_url(store.settings.url)


class RenewRound(Generic[S]):
    """One renewal round of a heartbeat: which batches go, in which order, with what time,
    and what each outcome means. The thread and the asyncio heartbeat share it; only their
    renew call differs (a plain call, or an awaited one).

    Batches go in deadline order, and one may use only its share of the time left before
    the next batches' deadlines. Timeline: t0 Redis A freezes; t1 the renewal of A's batch
    waits for A's deadline; t2 that is also the deadline of B's batch, on a healthy Redis,
    so B is lost for A's sake. With shares, A gives up in time for B.
    """

    def __init__(
        self,
        beat: _Beat,
        held: list[Held],
        store_of: Callable[[Held], S | None],
        log: Any,
    ) -> None:
        self._beat = beat
        self._log = log
        self.interval = renewal_interval(min(h.horizon for h in held))
        groups: dict[tuple[int, str], list[Held]] = {}
        self._stores: dict[int, S] = {}
        for h in held:
            store = store_of(h)
            if store is None:
                continue
            groups.setdefault((id(store), h.owner), []).append(h)
            self._stores[id(store)] = store
        self._jobs = sorted(groups.items(), key=lambda job: min(h.deadline for h in job[1]))
        #: per Redis server of this round: did every renewal sent to it succeed
        self._answered: dict[str, bool] = {}
        # The round plans the leases it renews; a lease added while it is in flight lowers
        # the plan from here on, and finish() keeps that. Timeline: t0 the round starts on a
        # slow Redis; t1 a lease of a short ttl is added, due before the round's interval
        # ends; t2 the round ends and must not plan past that lease's deadline.
        with beat.lock:
            beat.next_renew = math.inf

    def batches(self) -> Iterator[tuple[S, str, list[Held], float, float]]:
        """``(store, owner, batch, budget, sent)`` of each batch worth renewing, in order."""
        beat = self._beat
        for n, ((store_id, owner), batch) in enumerate(self._jobs):
            store = self._stores[store_id]
            later = [other for _, other in self._jobs[n + 1 :]]
            budget = renew_budget(batch, later, beat.clock(), store.settings)
            if budget < MIN_BUDGET:
                continue  # too late to confirm; the deadline check marks them lost
            beat.renewals += 1
            yield store, owner, batch, budget, beat.clock()

    def failed(self, store: S, batch: list[Held], sent: float, exc: Exception) -> None:
        """The renew call of ``batch`` to ``store``, sent at ``sent``, failed with ``exc``.

        Logged at ERROR once per Redis server until its renewals succeed again: the failure
        of another server (another store of the process) is never hidden behind this one's.
        """
        server = _server(store)
        self._answered[server] = False
        _observe_renew(self._beat.clock() - sent, False, len(batch))
        if server not in self._beat.failing:
            self._log.error("leases: renewal of %d lease(s) failed: %s", len(batch), exc)
        else:
            self._log.debug("leases: renewal still failing: %s", exc)

    def done(self, store: S, batch: list[Held], owner: str, lost: set[int], sent: float) -> None:
        """The renew call of ``batch`` answered; ``lost`` are the indices Redis no longer has."""
        self._answered.setdefault(_server(store), True)
        _observe_renew(self._beat.clock() - sent, True, len(batch))
        self._log.debug("leases: renewed %d lease(s) of %s", len(batch), owner)
        for h in confirm(batch, lost, sent):
            self._beat.lose(h, "Redis no longer has it")
        for h in batch:
            if h.revoked is not None and h.tell_revoked():
                report_revoked(h, self._beat.clock())

    def finish(self, now: float) -> None:
        """The round is over: plan the next one (sooner after a failure)."""
        beat = self._beat
        for server, ok in self._answered.items():
            if ok and server in beat.failing:
                self._log.warning("leases: renewals succeed again (%s)", server)
        # a server this round sent nothing to (its leases were released or lost) is
        # forgotten: its next failure is news again, at ERROR
        beat.failing = {server for server, ok in self._answered.items() if not ok}
        retry = min(self.interval, RETRY_AFTER_FAILURE) if beat.failing else self.interval
        with beat.lock:
            beat.next_renew = min(beat.next_renew, now + retry)


def renew_budget(
    batch: list[Held], later: list[list[Held]], start: float, settings: LeaseSettings
) -> float:
    """Seconds the renewal of ``batch`` may take, with ``later`` batches still to renew.

    At most until the batch's first deadline, and the socket timeout; with batches after it,
    only its share of the time left before theirs.
    """
    budget = min(min(h.deadline for h in batch) - start, settings.socket_timeout)
    if later:
        next_deadline = min(h.deadline for other in later for h in other)
        budget = min(budget, (next_deadline - start) / (len(later) + 1))
    return budget


def confirm(batch: list[Held], lost: set[int], sent: float) -> list[Held]:
    """Record a renewal sent at ``sent``; returns the leases of ``batch`` it found lost."""
    out = []
    for i, h in enumerate(batch):
        if i in lost:
            out.append(h)
        elif not h.lost:
            h.confirmed_at = max(h.confirmed_at, sent)
    return out


def report_lost(held: Held, why: str, now: float, extra: LostCallback | None) -> None:
    """Log a lease that was just marked lost, and run its ``on_lost`` callbacks."""
    logger.warning(
        "leases: lost %s after %.1fs (%s); the work may overlap with the next holder",
        held.resource,
        now - held.acquired_at,
        why,
    )
    for callback in [*held.on_lost, *([extra] if extra else [])]:
        try:
            callback(held)
        except Exception:
            logger.exception("leases: on_lost callback for %s failed", held.resource)


def report_revoked(held: Held, now: float) -> None:
    """Log a revocation a renewal just reported, and run the lease's ``on_lost`` callbacks
    (which raise :class:`~celery_leases.LeaseRevoked` in a task body that interrupts)."""
    logger.warning(
        "leases: %s was revoked after %.1fs (%s); it runs out in %.1fs unless released first",
        held.resource,
        now - held.acquired_at,
        held.revoked or "no reason given",
        held.revoke_left,
    )
    for callback in held.on_lost:
        try:
            callback(held)
        except Exception:
            logger.exception("leases: on_lost callback for %s failed", held.resource)


def _observe_renew(seconds: float, ok: bool, count: int) -> None:
    # a copy: install() or uninstall() in another thread may change the list meanwhile
    for observer in tuple(renew_observers):
        try:
            observer(seconds, ok, count)
        except Exception:
            logger.exception("leases: a renew observer failed")


def send_lease_lost(held: Held) -> None:
    """Send the ``lease_lost`` signal for ``held`` (the heartbeats' lost callback)."""
    signals.lease_lost.send(
        sender=held.resource,
        resource=held.resource,
        token=held.token,
        owner=held.owner,
        held_for=time.monotonic() - held.acquired_at,
        task_id=held.task_id,
    )
