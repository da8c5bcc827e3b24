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
import os
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import RedisError

from .. import _wait
from .._connect import aclose_client
from .._engine import LeaseEngine
from .._identity import Identity
from .._lease import Held, Want
from .._one_attempt import failure_of, one_attempt
from .._protocol import Op, Script, Send, SendReplicated, SendWithin, Sleep, Steps, adrive
from .._wait import Wait
from ..config import LeaseSettings
from .client import RENEW_CONNECTIONS, LoopState, make_async_client, restart_check, round_trip
from .lanes import Lane
from .operations import Operations
from .renewals import RenewalLines
from .replicated import send_replicated
from .shields import carried_here, carry, shielded
from .subscriber import Listening

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
    async def acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        wait: float | None = 0.0,
        task_id: str | None = None,
    ) -> list[Held]:
        """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

        As :meth:`LeaseStore.acquire` (see :func:`_wait.acquire`): 200 coroutines waiting
        for one resource cost one attempt per release, not 200; the waiters of one event
        loop share one subscriber connection. A cancelled waiter leaves nothing behind: no
        subscription, no lease, no place in the queue (see :meth:`run_wait`).

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        return await self.run_wait(_wait.acquire(self.engine, wants, ident, ttl, wait, task_id))

    async def run_wait(self, wait: Wait[T]) -> T:
        """Carry out a wait (see ``_wait``) on the running loop, its Listens on the loop's
        subscriber (:class:`~celery_leases._aio.subscriber.Listening`).

        The whole wait runs in a task of its own, so an attempt is never cut short. Timeline:
        t0 the acquire script runs in Redis and grants; t1 the caller is cancelled before
        the reply is read; t2 nobody would release the grant until its TTL. So a cancelled
        caller gets its ``CancelledError`` at once, and the task stops the wait at its next
        Listen (or at its end) and gives back what it has: the grant released, the queues
        left. The cancelled caller never waits for that.
        """
        state = self._state()
        send = partial(self._execute, state)
        listening = Listening(state, send, self.settings.socket_timeout)
        task, outcome = carry(self._waiting(wait, listening))
        listening.caller = outcome
        try:
            return await outcome
        except asyncio.CancelledError:
            listening.wake()
            state.tasks.add(task)  # aclose() waits for it, and what it gives back
            task.add_done_callback(state.tasks.discard)
            if not outcome.cancelled() and outcome.exception() is None:
                # it ended just as we were cancelled: its outcome came back to nobody
                self._spawn(state, self.run(wait.give_back(outcome.result())))
            raise

    async def _waiting(self, wait: Wait[T], listening: Listening) -> T:
        """:meth:`run_wait`'s task: the wait, then the give-back if its caller went away."""
        try:
            outcome = await adrive(wait.steps, listening.execute, RedisError, failure_of)
        except BaseException as exc:
            if _wait.stopped(wait, exc):  # abandoned at a Listen, or the loop is closing
                await self.run(wait.give_back(None))
            raise
        finally:
            listening.close()
        if listening.abandoned:  # the outcome came back to nobody
            await self.run(wait.give_back(outcome))
        return outcome

    def subscribed_channels(self) -> set[str]:
        """The release channels the running loop's subscriber listens to (for tests)."""
        state = self._loops.get(asyncio.get_running_loop())
        subscriber = None if state is None else state.subscriber
        return set() if subscriber is None else subscriber.channels()
