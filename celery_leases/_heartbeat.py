"""Heartbeat: one daemon thread per process that renews every lease the process holds."""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, Generic, NamedTuple, Protocol, TypeVar

from celery.utils.log import get_logger

from . import signals
from ._protocol import drive
from .config import renewal_interval
from .exceptions import LeaseError

if TYPE_CHECKING:
    from ._lease import Held
    from ._store import LeaseStore
    from .config import LeaseSettings

__all__ = ("Heartbeat", "RenewObserver", "heartbeat", "renew_observers")

logger = get_logger(__name__)

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


class Heartbeat:
    """Renews held leases every ``renewal_interval(min(horizon))`` (a third of the shortest)
    with one Redis call per store and owner.

    It records, on the monotonic clock, when each lease was last confirmed (the time the
    renewal was *sent*, which is no later than when Redis extended it). A lease not confirmed
    by ``confirmed + horizon`` (``horizon = min(ttl, owner liveness) * (1 - lost_margin)``) is
    marked lost before Redis could hand it to anyone else; its ``on_lost`` callbacks run and
    ``lost_callback`` is called. The thread never dies on a Redis error: it logs and tries
    again.

    Timeline it guards against: t0 A renews; t1 Redis pauses; t2 A's renewal hangs; t3 A's
    deadline (t0 + horizon) passes, A stops trusting the lease; t4 Redis expires the key
    (t0 + ttl > t3); t5 B acquires. A learns at t3 < t5 because every renewal is sent with a
    timeout that ends at the first deadline.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        lost_callback: LostCallback | None = None,
        autostart: bool = True,
    ) -> None:
        self.clock = clock
        self._lost_callback = lost_callback
        # False: add() starts no thread and the owner drives tick() (tests with a fake clock)
        self._autostart = autostart
        self._held: weakref.WeakKeyDictionary[Held, None] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False  # a thread was started and has not ended (under self.lock)
        self.next_renew = 0.0
        # clock time at which the thread looks again (None: it is looking now, or about to,
        # so add() must wake it)
        self._planned: float | None = None
        self.failing = False
        self.renewals = 0  # number of renew calls sent (for benchmarks and tests)

    # --- registry --------------------------------------------------------------------------
    def add(self, held: Held) -> None:
        """Start renewing ``held``; starts the thread on first use.

        The thread is woken only when the new lease needs a renewal sooner than the thread
        planned to look again: waking it for every acquire would cost more than the acquire.
        """
        with self.lock:
            idle = len(self._held) == 0  # released and lost leases are discarded
            self._held[held] = None
            due = held.confirmed_at + renewal_interval(held.horizon)
            # with nothing held, an old next_renew is meaningless
            self.next_renew = due if idle else min(self.next_renew, due)
            # _running, not Thread.is_alive(): that takes the thread's state lock, at every add
            if self._autostart and not self._running:
                self._stopping.clear()
                self._thread = threading.Thread(
                    target=self._run, name="celery-leases-heartbeat", daemon=True
                )
                self._running = True
                self._thread.start()
            wake = self._planned is None or self.next_renew < self._planned
        if wake:
            self._wake.set()

    def discard(self, held: Held) -> None:
        """Stop renewing ``held``."""
        with self.lock:
            self._held.pop(held, None)

    def snapshot(self) -> list[Held]:
        """The leases being renewed now."""
        with self.lock:
            return [h for h in self._held if not h.lost and not h.released]

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread (leases are no longer renewed) and wait for it."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self.lock:  # the next add() starts a thread again
                self._running = False

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                delay = self.tick()
            except Exception:  # the heartbeat must outlive any bug in a callback
                logger.exception("leases: heartbeat iteration failed")
                delay = RETRY_AFTER_FAILURE
            if delay is None:
                # Nothing held: look again after a while rather than sleep until add() wakes
                # us. Waking the thread for every acquire costs a thread switch per acquire
                # (it ran after the release, found nothing, slept, was woken again...).
                delay = IDLE_LOOK
            with self.lock:
                self._planned = self.clock() + delay
            # an add() between tick() and here sees the new plan, or already set _wake
            self._wake.wait(delay)
            with self.lock:
                self._wake.clear()
                self._planned = None

    def tick(self) -> float | None:
        """Do what is due now; return seconds until something is due (None: nothing held)."""
        return drive(tick_steps(self, _store_of, logger), _renew_call, LeaseError)

    def lose(self, held: Held, why: str) -> None:
        if not held.mark_lost():
            return
        self.discard(held)
        report_lost(held, why, self.clock(), self._lost_callback)


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
            beat.lose(h, "not confirmed in time")
    held = [h for h in held if not h.lost]
    if not held:
        return None
    if now >= beat.next_renew:
        round_ = RenewRound(beat, held, store_of, log)
        for store, owner, batch, budget, sent in round_.batches():
            try:
                lost = yield RenewCall(store, owner, batch, budget)
            except LeaseError as exc:
                round_.failed(batch, sent, exc)
                continue
            round_.done(batch, owner, lost, sent)
        round_.finish(now)
        now = beat.clock()
        held = [h for h in held if not h.lost and not h.released]
        if not held:
            return None
    first_deadline = min(h.deadline for h in held)
    return max(0.0, min(beat.next_renew, first_deadline) - now)


def _store_of(held: Held) -> LeaseStore:
    return held.store


def _renew_call(call: RenewCall) -> set[int]:
    lost: set[int] = call.store.renew(call.batch, call.owner, call.budget)
    return lost


class _Beat(Protocol):
    """What a :class:`RenewRound` needs of its heartbeat (the thread or the asyncio task)."""

    clock: Callable[[], float]
    failing: bool
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
        self.ok = True
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

    def failed(self, batch: list[Held], sent: float, exc: Exception) -> None:
        """The renew call of ``batch``, sent at ``sent``, failed with ``exc``."""
        self.ok = False
        _observe_renew(self._beat.clock() - sent, False, len(batch))
        if not self._beat.failing:
            self._log.error("leases: renewal of %d lease(s) failed: %s", len(batch), exc)
        else:
            self._log.debug("leases: renewal still failing: %s", exc)

    def done(self, batch: list[Held], owner: str, lost: set[int], sent: float) -> None:
        """The renew call of ``batch`` answered; ``lost`` are the indices Redis no longer has."""
        _observe_renew(self._beat.clock() - sent, True, len(batch))
        self._log.debug("leases: renewed %d lease(s) of %s", len(batch), owner)
        for h in confirm(batch, lost, sent):
            self._beat.lose(h, "Redis no longer has it")

    def finish(self, now: float) -> None:
        """The round is over: plan the next one (sooner after a failure)."""
        beat = self._beat
        if self.ok and beat.failing:
            self._log.warning("leases: renewals succeed again")
        beat.failing = not self.ok
        retry = self.interval if self.ok else min(self.interval, RETRY_AFTER_FAILURE)
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


def _observe_renew(seconds: float, ok: bool, count: int) -> None:
    # a copy: install() or uninstall() in another thread may change the list meanwhile
    for observer in tuple(renew_observers):
        try:
            observer(seconds, ok, count)
        except Exception:
            logger.exception("leases: a renew observer failed")


_instance: Heartbeat | None = None
_instance_lock = threading.Lock()


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


def heartbeat() -> Heartbeat:
    """This process's heartbeat (made on first use, and again in a forked child)."""
    global _instance
    instance = _instance  # the hot path: one read (a fork resets it in the child)
    if instance is not None:
        return instance
    with _instance_lock:
        if _instance is None:
            _instance = Heartbeat(lost_callback=send_lease_lost)
        return _instance


def _reset_after_fork() -> None:
    # the thread did not survive the fork, and the leases it renewed are the parent's
    global _instance, _instance_lock
    _instance = None
    _instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
