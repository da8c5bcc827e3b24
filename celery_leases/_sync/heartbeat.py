"""Heartbeat: one daemon thread per process that renews every lease the process holds."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery.utils.log import get_logger

from .._protocol import drive
from .._renewround import (
    IDLE_LOOK,
    RETRY_AFTER_FAILURE,
    LostCallback,
    RenewCall,
    report_lost,
    send_lease_lost,
    tick_steps,
)
from ..config import renewal_interval
from ..exceptions import LeaseError

if TYPE_CHECKING:
    from .._lease import Held
    from .driver import LeaseStore

__all__ = ("Heartbeat", "heartbeat")

logger = get_logger(__name__)


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
        self._held: weakref.WeakKeyDictionary[Held, LeaseStore] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False  # a thread was started and has not ended (under self.lock)
        self.next_renew = 0.0
        # clock time at which the thread looks again (None: it is looking now, or about to,
        # so add() must wake it)
        self._planned: float | None = None
        self.failing: set[str] = set()  # the servers whose renewals fail (see RenewRound)
        self.renewals = 0  # number of renew calls sent (for benchmarks and tests)

    # --- registry --------------------------------------------------------------------------
    def add(self, held: Held, store: LeaseStore) -> None:
        """Start renewing ``held`` through ``store``; starts the thread on first use.

        The thread is woken only when the new lease needs a renewal sooner than the thread
        planned to look again: waking it for every acquire would cost more than the acquire.
        """
        with self.lock:
            idle = len(self._held) == 0  # released and lost leases are discarded
            self._held[held] = store
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
        return drive(tick_steps(self, self._held.get, logger), _renew_call, LeaseError)

    def lose(self, held: Held, why: str) -> None:
        if not held.mark_lost():
            return
        self.discard(held)
        report_lost(held, why, self.clock(), self._lost_callback)


def _renew_call(call: RenewCall) -> set[int]:
    lost: set[int] = call.store.renew(call.batch, call.owner, call.budget)
    return lost


_instance: Heartbeat | None = None
_instance_lock = threading.Lock()


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
