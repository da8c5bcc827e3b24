"""AsyncLeaseStore: the asyncio driver of the lease protocol, the only async code that talks
to Redis.

It carries out the requests of the core operations on the running event loop: clients per
loop (``client``), the lane (``lanes``), the subscriber (``subscriber``), the renewals
(``renewals``), WAIT routing (``replicated``) and shields against cancellation
(``shields``). The methods that run one operation each are in ``operations``. Its twin is
``_sync/driver.py::LeaseStore``.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import RedisError

from .. import _grants
from .._connect import aclose_client
from .._engine import LeaseEngine
from .._grants import Busy, busy_error, waiting_time
from .._identity import Identity
from .._lease import Held, Want
from .._one_attempt import failure_of, one_attempt
from .._protocol import Op, Script, Send, SendReplicated, SendWithin, Sleep, Steps, adrive
from ..config import LeaseSettings
from ..exceptions import LeaseBusy
from .client import RENEW_CONNECTIONS, LoopState, make_async_client, restart_check, round_trip
from .lanes import Lane
from .operations import Operations
from .renewals import RenewalLines
from .replicated import send_replicated
from .shields import carried_here, carry, shielded
from .subscriber import Subscriber

__all__ = ("AsyncLeaseStore",)

T = TypeVar("T")


class AsyncLeaseStore(Operations):
    """The asyncio driver of the lease protocol, the twin of ``_sync/driver.py::LeaseStore``.

    It runs the same core operations (``_grants``, ``_inspect``) with the same engine as the
    sync driver of its settings, so the scripts, keys, owner registry and tokens are the
    same, and carries out their requests on the running loop (:meth:`run`): per-loop
    clients, one subscriber, shields against cancellation, a deadline for renewals. The
    leases it grants exclude, and are excluded by, the sync side's. Clients are made per
    event loop (an asyncio connection belongs to its loop). Every redis error is raised as
    :class:`~celery_leases.exceptions.LeaseBackendError`.
    """

    def __init__(self, settings: LeaseSettings, *, engine: LeaseEngine | None = None) -> None:
        self.settings = settings
        #: the protocol's memory in this process (pass the sync driver's to share it)
        self.engine = engine = LeaseEngine(settings) if engine is None else engine
        self.keys = engine.keys
        self._renewals = RenewalLines(engine)
        self._lock = threading.Lock()
        self._loops: dict[asyncio.AbstractEventLoop, LoopState] = {}
        self._pid = os.getpid()

    # --- clients --------------------------------------------------------------------------
    def _state(self) -> LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is not None and self._pid == os.getpid():
            return state
        with self._lock:
            if self._pid != os.getpid():
                self._loops, self._pid = {}, os.getpid()
            for old in [other for other in self._loops if other.is_closed()]:
                del self._loops[old]  # its connections went with it
            state = self._loops.get(loop)
            if state is None:
                client = make_async_client(
                    self.settings, on_connect=restart_check(self.keys, self.settings)
                )
                state = self._loops[loop] = LoopState(
                    client=client,
                    renew_client=make_async_client(
                        self.settings, max_connections=RENEW_CONNECTIONS
                    ),
                )
                pool = getattr(client, "connection_pool", None)  # a cluster client has none
                if not self.engine.cluster and pool is not None and Lane.usable(pool):
                    state.lane = Lane(pool, self.settings.socket_timeout)
            return state

    async def aclose(self) -> None:
        """Close the running event loop's connections (new ones are made on next use)."""
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            return
        # acquires of cancelled callers, and the releases they start: let them finish first
        end = time.monotonic() + self.settings.socket_timeout
        while state.tasks and time.monotonic() < end:
            await asyncio.wait(set(state.tasks), timeout=end - time.monotonic())
        with self._lock:
            if self._loops.get(loop) is state:
                del self._loops[loop]
        if state.subscriber is not None:
            await state.subscriber.aclose()
        if state.lane is not None:
            await state.lane.aclose()
        await aclose_client(state.client)
        await aclose_client(state.renew_client)
        for node_client in state.nodes.values():
            await node_client.aclose()

    def _spawn(self, state: LoopState, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

    async def ping(self) -> bool:
        """True if Redis answers."""
        try:
            return bool(await shielded(self._state().client.ping()))
        except RedisError as exc:
            raise self.engine.backend_error("answer PING", exc) from exc

    # --- the driver -----------------------------------------------------------------------
    async def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation on the running loop (see :meth:`LeaseStore.run`).

        Each request is sent in a task of its own (:func:`_shielded`): a cancelled caller
        gets its ``CancelledError`` at once, the request runs to its end, and the operation
        is abandoned where it stood.
        """
        state = self._state()
        return await adrive(steps, partial(self._execute, state), RedisError, failure_of)

    async def _execute(self, state: LoopState, op: Op) -> Any:
        kind = type(op)
        # inside a task of _carry (an acquire attempt, a holder's release) the caller is
        # shielded already: a request needs no task of its own there
        bare = carried_here()
        if kind is Send:
            assert isinstance(op, Send)
            lane = state.lane
            if (
                lane is not None
                and not lane.busy
                and len(op.calls) == 1
                and type(op.calls[0]) is Script
                and not op.transaction
            ):
                lane.busy = True  # now, not when a task of _shielded starts: it is ours
                sending = lane.send(state.client, op)
                return await (sending if bare else shielded(sending))
            if op.once:
                with one_attempt():  # the request's task inherits it
                    sending = round_trip(state.client, op.calls, op.transaction)
                    return await (sending if bare else shielded(sending))
            sending = round_trip(state.client, op.calls, op.transaction)
            return await (sending if bare else shielded(sending))
        if kind is SendReplicated:
            assert isinstance(op, SendReplicated)
            with one_attempt():
                replicated = send_replicated(state, self.engine, op.calls, renewal=False)
                return await (replicated if bare else shielded(replicated))
        if kind is SendWithin:
            assert isinstance(op, SendWithin)
            return await self._renewals.send(state, op.calls, op.timeout)
        if kind is Sleep:
            assert isinstance(op, Sleep)
            await asyncio.sleep(op.seconds)
            return None
        raise TypeError(f"not a request of the lease protocol: {op!r}")

    # --- acquire --------------------------------------------------------------------------
    async def _attempt(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        task_id: str | None,
        ticket: _grants.Ticket | None = None,
    ) -> list[Held] | Busy:
        """:meth:`try_acquire`, and if the caller is cancelled meanwhile, nothing is kept.

        Timeline: t0 the acquire script runs in Redis and grants; t1 the caller is cancelled
        before the reply is read; t2 nobody would release the grant until its TTL. So the
        attempt runs shielded, and a grant that comes back to a cancelled caller is released.
        """
        state = self._state()
        attempt, outcome = carry(self.try_acquire(wants, ident, ttl, task_id, ticket))
        try:
            return await outcome
        except asyncio.CancelledError:
            # also when it is done already: it may have completed just as we were cancelled
            state.tasks.add(attempt)  # aclose() waits for it, and its release
            attempt.add_done_callback(lambda done: self._release_orphan(state, done, wants, ticket))
            raise

    def _release_orphan(
        self,
        state: LoopState,
        attempt: asyncio.Future[list[Held] | Busy | None],
        wants: Sequence[Want],
        ticket: _grants.Ticket | None,
    ) -> None:
        state.tasks.discard(attempt)
        if attempt.cancelled() or attempt.exception() is not None:
            return
        granted = attempt.result()
        engine = self.engine
        if isinstance(granted, list) and granted:
            self._spawn(state, self.run(_grants.release_quietly(engine, granted)))
        elif isinstance(granted, Busy) and ticket is not None:
            # it queued the ticket after its caller left (and left the queues): leave again
            ticket.queued = {w.resource for w in wants}
            self._spawn(state, self.run(_grants.leave_queues(engine, wants, ticket)))

    async def acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        wait: float | None = 0.0,
        task_id: str | None = None,
    ) -> list[Held]:
        """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

        As :meth:`LeaseStore.acquire`: a waiter takes a ticket and is woken alone, on its
        own channel, when a release makes it the head of the waiter queue (first come, first
        served, across processes and loops: 200 coroutines waiting for one resource cost
        one attempt per release, not 200), and by the blocking holder's expiry at the
        latest; it holds nothing while it waits. The waiters of one event loop share one
        subscriber connection. A cancelled waiter leaves nothing behind: no subscription,
        no lease, no place in the queue (it leaves in a task of its own).

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        start = time.monotonic()
        outcome = await self._attempt(wants, ident, ttl, task_id)
        if not isinstance(outcome, Busy):
            return outcome
        if wait is not None and wait <= 0:
            raise busy_error(outcome, await self.holder_task(outcome.resource))
        deadline = math.inf if wait is None else start + wait
        state = self._state()
        ticket = _grants.new_ticket(self.engine, wants, ident.owner, ttl, task_id)
        done = False
        try:
            with _grants.ordering(self.engine, wants, ticket):
                granted = await self._wait(
                    state, wants, ident, ttl, task_id, start, deadline, ticket
                )
            done = True
            return granted
        except LeaseBusy:
            done = True  # timed out: queued only where it was last blocked
            raise
        finally:
            if not done:  # failed or cancelled: it may be queued anywhere it waited
                ticket.queued = {w.resource for w in wants}
            if ticket.queued:  # leave, and wake the next waiter; never waited for
                self._spawn(state, self.run(_grants.leave_queues(self.engine, wants, ticket)))

    async def _wait(
        self,
        state: LoopState,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        task_id: str | None,
        start: float,
        deadline: float,
        ticket: _grants.Ticket,
    ) -> list[Held]:
        """Subscribe, then try again on each wake-up (or expiry) until granted or ``deadline``,
        or until a release hands the lease over (lua/release.lua)."""
        keys = self.engine.resource_keys
        channels = sorted({keys(w.resource).channel for w in wants})
        mine = self.keys.waiter_channel(ticket.id)
        channels.append(mine)
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        subscriber = await self._subscribe(state, channels, event)
        try:
            while True:
                event.clear()  # before the attempt: a release from now on wakes us
                outcome = await self._attempt(wants, ident, ttl, task_id, ticket)
                now = time.monotonic()
                pause = waiting_time(outcome, now, deadline)
                if pause is None:
                    if not isinstance(outcome, Busy):
                        return outcome
                    raise busy_error(outcome, await self.holder_task(outcome.resource), now - start)
                # woken by a release, or by the blocking holder's expiry at the latest
                timer = loop.call_later(pause, event.set)
                try:
                    await event.wait()
                finally:
                    timer.cancel()
                token = subscriber.handed.pop(mine, None)
                if token is not None and ticket.accepts(token):
                    return _grants.handed(self.engine, wants, ttl, ticket, token)
                if subscriber.broken is not None:
                    subscriber.remove(channels, event)
                    subscriber = await self._subscribe(state, channels, event)
        finally:
            subscriber.remove(channels, event)

    async def _subscribe(
        self, state: LoopState, channels: list[str], event: asyncio.Event
    ) -> Subscriber:
        subscriber = state.subscriber
        if subscriber is None or subscriber.broken is not None:
            subscriber = state.subscriber = Subscriber(state.client, self.settings.socket_timeout)
        try:
            await subscriber.add(channels, event)
        except RedisError as exc:
            raise self.engine.backend_error("wait for a release", exc) from exc
        return subscriber

    def subscribed_channels(self) -> set[str]:
        """The release channels the running loop's subscriber listens to (for tests)."""
        state = self._loops.get(asyncio.get_running_loop())
        subscriber = None if state is None else state.subscriber
        return set() if subscriber is None else subscriber.channels()
