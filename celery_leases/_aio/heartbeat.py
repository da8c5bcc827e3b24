"""Heartbeat: one task per event loop that renews every lease held on that loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery.utils.log import get_logger

from .._protocol import adrive
from .._renewround import (
    IDLE_LOOK,
    RETRY_AFTER_FAILURE,
    RenewCall,
    report_lost,
    send_lease_lost,
    tick_steps,
)
from ..config import renewal_interval
from ..exceptions import LeaseError

if TYPE_CHECKING:
    from .._lease import Held
    from .driver import AsyncLeaseStore

__all__ = ("Heartbeat", "loop_heartbeat")

logger = get_logger(__name__)


class Heartbeat:
    """Renews the leases held on one event loop, as the sync heartbeat thread does.

    One task, started on the first lease and ended after a second with nothing held. Every
    ``renewal_interval(min(horizon))`` it sends one renewal per store and owner (the owner id
    is the process's, as on the sync side: both renew its liveness with ``ZADD GT``, so
    neither can shorten what the other set). Each renewal has a deadline, the time left
    before its first lease would count as lost, so a stalled Redis cannot hide a loss: the
    lease is marked lost at ``last confirmed renewal + horizon`` on the monotonic clock,
    before Redis could expire it. A blocked event loop stops this task too; the deadline
    check then marks the leases lost as soon as the loop runs again.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._held: weakref.WeakKeyDictionary[Held, AsyncLeaseStore] = weakref.WeakKeyDictionary()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.next_renew = 0.0
        # RenewRound takes it around next_renew; add() runs on this task's own event loop, so
        # there is nothing to guard
        self.lock = contextlib.nullcontext()
        self._planned: float | None = None  # clock time of the next look (None: looking now)
        self.failing: set[str] = set()  # the servers whose renewals fail (see RenewRound)
        self.renewals = 0  # renew calls sent (for tests)

    def add(self, held: Held, store: AsyncLeaseStore) -> None:
        """Start renewing ``held`` through ``store``; starts the task if it is not running."""
        idle = len(self._held) == 0  # released and lost leases are discarded
        self._held[held] = store
        due = held.confirmed_at + renewal_interval(held.horizon)
        self.next_renew = due if idle else min(self.next_renew, due)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="celery-leases-heartbeat"
            )
        elif self._planned is None or self.next_renew < self._planned:
            self._wake.set()

    def discard(self, held: Held) -> None:
        """Stop renewing ``held``."""
        self._held.pop(held, None)

    def snapshot(self) -> list[Held]:
        """The leases being renewed now."""
        return [h for h in self._held if not h.lost and not h.released]

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while True:
            try:
                delay = await self.tick()
            except Exception:  # the heartbeat must outlive any bug in a callback
                logger.exception("leases: heartbeat iteration failed")
                delay = RETRY_AFTER_FAILURE
            if delay is None:
                await self._sleep(IDLE_LOOK)
                if not self.snapshot():
                    return  # add() starts a new task
                continue
            await self._sleep(delay)

    async def _sleep(self, delay: float) -> None:
        self._planned = self.clock() + delay
        timer = asyncio.get_running_loop().call_later(delay, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
            self._wake.clear()
            self._planned = None

    async def tick(self) -> float | None:
        """Do what is due now; return seconds until something is due (None: nothing held)."""
        steps = tick_steps(self, self._held.get, logger)
        return await adrive(steps, _renew_call, LeaseError)

    def lose(self, held: Held, why: str) -> None:
        if not held.mark_lost():
            return
        self.discard(held)
        report_lost(held, why, self.clock(), send_lease_lost)


_beats: dict[asyncio.AbstractEventLoop, Heartbeat] = {}
_beats_lock = threading.Lock()


def loop_heartbeat() -> Heartbeat:
    """The running event loop's heartbeat (made on first use)."""
    loop = asyncio.get_running_loop()
    beat = _beats.get(loop)
    if beat is None:
        with _beats_lock:
            for old in [other for other in _beats if other.is_closed()]:
                del _beats[old]
            beat = _beats.setdefault(loop, Heartbeat())
    return beat


def _reset_after_fork() -> None:
    # a child runs none of its parent's loops, and the leases renewed there are the parent's
    global _beats_lock
    _beats.clear()
    _beats_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


async def _renew_call(call: RenewCall) -> set[int]:
    lost: set[int] = await call.store.renew(call.batch, call.owner, call.budget)
    return lost
