"""AsyncLeaseStore: the asyncio side of the store, the only async code that talks to Redis."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar

import redis.asyncio as aredis
from celery.utils.log import get_logger
from redis.asyncio.client import PubSub
from redis.backoff import NoBackoff
from redis.exceptions import AskError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _grants, _inspect, _lifetime
from ._connect import aclose_client, parse_target
from ._connect import make_async_client as make_deployment_client
from ._grants import Busy, busy_error, waiting_time
from ._identity import Identity
from ._lease import Held, Want
from ._once import (
    AsyncOnceRetry,
    failure_of,
    once_on_cluster,
    one_attempt,
)
from ._protocol import (
    Call,
    Command,
    Op,
    Script,
    Send,
    SendReplicated,
    SendWithin,
    Sleep,
    Steps,
    adrive,
    words_of,
)
from ._scripts import SOURCE
from ._sync.driver import LeaseStore
from ._wire import handoff, pack, where
from .config import LeaseSettings, safe_url
from .exceptions import LeaseBusy, LeaseConfigError

__all__ = ("AsyncLeaseStore", "make_async_client", "shielded")

logger = get_logger(__name__)


T = TypeVar("T")

#: connections of one event loop's client; more concurrent commands wait for a free one
#: (up to the socket timeout) instead of opening thousands of connections under load
MAX_CONNECTIONS: Final = 64
#: connections of one event loop's renewal client (the heartbeat sends one call at a time)
RENEW_CONNECTIONS: Final = 2


def make_async_client(
    settings: LeaseSettings,
    *,
    max_connections: int = MAX_CONNECTIONS,
    on_connect: Callable[[Any], Awaitable[None]] | None = None,
) -> aredis.Redis:
    """An asyncio client for ``settings``, with the options of the sync store's client.

    The one place asyncio clients are made. A client's connections belong to the event loop
    that opened them, so the store makes one per loop. Its pool blocks when all of its
    connections are in use (up to ``socket_timeout``) rather than failing. ``on_connect``
    runs first on each new connection (the restart check: see _lifetime).
    """
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.socket_connect_timeout,
        # one retry on a connection error, but none for the script calls, which recover on
        # their own (see _lostreply)
        "retry": AsyncOnceRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        "client_name": "celery_leases",
        "max_connections": max_connections,
    }
    try:
        target = parse_target(settings.url)
        if target.kind != "single":  # Sentinel or Cluster: their own pools
            client = make_deployment_client(target, on_connect, **common)
            if target.kind == "cluster":
                once_on_cluster(client)  # it retries on its own, also the script calls
            return client
        if on_connect is not None:
            common["redis_connect_func"] = on_connect
        pool = aredis.BlockingConnectionPool.from_url(
            settings.url, timeout=settings.socket_timeout, **common
        )
    except (ValueError, TypeError, RedisError) as exc:
        msg = f"redis_url {safe_url(settings.url)!r} is not usable: {exc}"
        raise LeaseConfigError(msg) from None
    return aredis.Redis.from_pool(pool)


class _Subscriber:
    """One pub/sub connection per event loop that wakes the coroutines waiting for releases.

    Each waiter registers an :class:`asyncio.Event` for the release channels of what it
    wants; a release message sets the events of that channel's waiters. A channel is
    subscribed while it has waiters and unsubscribed when its last waiter leaves (cancelled
    or not). SUBSCRIBE and UNSUBSCRIBE are sent under one lock, in the order they were
    decided, and a waiter goes on only once every SUBSCRIBE sent for its channels so far is
    confirmed: a release between its failed attempt and a late subscription would otherwise
    go unheard. Timeline: t0 A unsubscribes c (its last waiter left); t1 B subscribes c again
    before the UNSUBSCRIBE is confirmed; t2 the first SUBSCRIBE's confirmation arrives, but
    B must wait for the second, which Redis handles after the UNSUBSCRIBE.
    """

    def __init__(self, client: aredis.Redis, confirm_timeout: float) -> None:
        self._pubsub: PubSub = client.pubsub()
        self._timeout = confirm_timeout
        self._lock = asyncio.Lock()
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._subscribed: set[str] = set()  # SUBSCRIBE sent, and no UNSUBSCRIBE since
        self._pending: dict[str, int] = {}  # SUBSCRIBE commands not yet confirmed
        self._ready: dict[str, asyncio.Event] = {}  # set once a subscription is in force
        #: waiter channel -> the token of a lease handed over on it (lua/release.lua), until
        #: its waiter takes it or leaves
        self.handed: dict[str, str] = {}
        self._reader: asyncio.Task[None] | None = None
        self._apply_due = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.broken: BaseException | None = None

    def channels(self) -> set[str]:
        """The channels subscribed now (or about to be)."""
        return set(self._subscribed)

    async def add(self, channels: Sequence[str], event: asyncio.Event) -> None:
        """Wake ``event`` on a release on any of ``channels``, once subscribed to all of them."""
        for channel in channels:
            self._waiters.setdefault(channel, set()).add(event)
        try:
            await _shielded(self._apply())
            end = time.monotonic() + self._timeout
            for channel in channels:
                ready = self._ready.get(channel)
                if ready is None:  # broken meanwhile
                    break
                if not ready.is_set() and not await _within(ready.wait(), end - time.monotonic()):
                    exc = RedisTimeoutError("no SUBSCRIBE confirmation")
                    self._break(exc)  # its waiters start over on a new connection
                    raise exc
            if self.broken is not None:
                raise RedisConnectionError(f"subscriber connection failed: {self.broken}")
        except BaseException:
            self.remove(channels, event)
            raise

    def remove(self, channels: Sequence[str], event: asyncio.Event) -> None:
        """Stop waking ``event``; a channel without waiters is unsubscribed soon after.

        Never waits, so a cancelled waiter can always leave; the UNSUBSCRIBE is sent by a
        task of its own.
        """
        emptied = False
        for channel in channels:
            waiters = self._waiters.get(channel)
            if waiters is None:
                continue
            waiters.discard(event)
            if not waiters:
                del self._waiters[channel]
                self.handed.pop(channel, None)
                emptied = True
        if emptied and not self._apply_due and self.broken is None:
            self._apply_due = True
            self._spawn(self._apply_quietly())

    async def _apply(self) -> None:
        """Send what makes the subscriptions match the waiters (SUBSCRIBE and UNSUBSCRIBE)."""
        async with self._lock:
            self._apply_due = False
            if self.broken is not None:
                raise RedisConnectionError(f"subscriber connection failed: {self.broken}")
            wanted = set(self._waiters)
            drop = sorted(self._subscribed - wanted)
            add = sorted(wanted - self._subscribed)
            try:
                if drop:
                    self._subscribed.difference_update(drop)
                    for channel in drop:
                        if not self._pending.get(channel):
                            self._ready.pop(channel, None)
                    await self._pubsub.unsubscribe(*drop)
                if add:
                    for channel in add:
                        self._subscribed.add(channel)
                        self._pending[channel] = self._pending.get(channel, 0) + 1
                        self._ready.setdefault(channel, asyncio.Event()).clear()
                    await self._pubsub.subscribe(*add)
                    if self._reader is None:
                        connection = self._pubsub.connection
                        if connection is not None:
                            connection.register_connect_callback(self._reconnected)
                        self._reader = asyncio.get_running_loop().create_task(
                            self._read(), name="celery-leases-subscriber"
                        )
            except (RedisError, OSError) as exc:
                self._break(exc)
                raise

    def _reconnected(self, connection: object) -> None:
        """redis-py reconnected (and resubscribes): wake every waiter to try again.

        A release published while the connection was down was never heard.
        """
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    async def _apply_quietly(self) -> None:
        # on failure _apply broke the subscriber: its waiters were woken and start over
        with contextlib.suppress(RedisError, OSError):
            await self._apply()

    async def _read(self) -> None:
        try:
            while True:
                message = await self._pubsub.get_message(timeout=None)
                if message is None:
                    continue
                kind, channel = message.get("type"), str(message.get("channel"))
                if kind == "message":
                    token = handoff(kind, channel, message.get("data"), channel)
                    if token is not None:
                        self.handed[channel] = token
                    for event in self._waiters.get(channel, ()):
                        event.set()
                elif kind == "subscribe":
                    left = self._pending.get(channel, 0) - 1
                    if left > 0:
                        self._pending[channel] = left
                        continue
                    self._pending.pop(channel, None)
                    if channel in self._subscribed:
                        self._ready.setdefault(channel, asyncio.Event()).set()
                    else:
                        self._ready.pop(channel, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        """The connection failed: wake every waiter (each tries again on a new subscriber)."""
        if self.broken is not None:
            return
        self.broken = exc
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()
        for ready in self._ready.values():
            ready.set()
        self._spawn(self.aclose())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Close the connection (the waiters still registered are woken)."""
        if self.broken is None:
            self.broken = RedisConnectionError("subscriber closed")
            for waiters in self._waiters.values():
                for event in waiters:
                    event.set()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


@dataclass
class _LoopState:
    """What a store keeps per event loop: clients, scripts, subscriber, background tasks."""

    client: aredis.Redis
    renew_client: aredis.Redis
    subscriber: _Subscriber | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # on a cluster with min_replicas: plain clients of single nodes, (host, port, renewal?)
    # -> client; a WAIT has no key, so it goes down the connection of the write before it
    nodes: dict[tuple[str, int, bool], aredis.Redis] = field(default_factory=dict)
    # standalone or Sentinel: the connection of single script calls (see _Lane)
    lane: _Lane | None = None


class _Lane:
    """A connection of its own for single script calls, one call at a time (the hot path).

    redis-py's per-command path (the pool's get and release with their observability
    records, the retry wrapper, a task of :func:`asyncio.wait_for` around each socket write
    before Python 3.12) costs more than the round trip itself on a loopback. A call that
    finds the lane free goes down its connection directly; others take the pool's path. The
    outcome of a call is the same as on that path:

    - before each call, a connection that was closed (its EOF seen) or has unread data is
      connected afresh, with the restart check and the socket timeouts of any new
      connection: a connection killed between calls costs a reconnect, not a lost reply.
      (The pool makes this check too, but skips it when redis-py's maintenance
      notifications are on.)
    - the write and the read have one deadline, ``socket_timeout``; a reply not read by
      then is redis-py's TimeoutError, and the connection is closed. A cut connection is its
      ConnectionError. Both leave the outcome unknown: the caller throws a lost Failure.
    - an error reply is raised as it is; NOSCRIPT (nothing ran) goes the pool's path.
    - a cancelled call closes the connection (redis-py does, on any error while reading).

    The connection is made like the pool's (the same class and options: TLS, Sentinel's
    master lookup, the restart check), but apart from it. Its ``socket_timeout`` is set while
    it connects only; its calls run under the lane's own deadline.
    """

    def __init__(self, pool: Any, timeout: float) -> None:
        self._timeout = timeout
        self.conn: Any = pool.connection_class(**{**pool.connection_kwargs})
        self.busy = False

    @staticmethod
    def usable(pool: Any) -> bool:
        """True if this redis-py and Python have what the lane uses."""
        if sys.version_info < (3, 11):  # asyncio.timeout
            return False
        made = getattr(pool, "connection_class", None)
        return all(callable(getattr(made, name, None)) for name in ("can_read", "pack_command"))

    async def call(self, words: Sequence[Any]) -> Any:
        """Send one command down the lane and read its reply (the caller set ``busy``)."""
        conn = self.conn
        if conn.is_connected and await self._stale(conn):
            # closed by the server (its EOF was seen), or a reply nobody read: start afresh
            await conn.disconnect()
        if not conn.is_connected:
            conn.socket_timeout = self._timeout  # a connect's reads: as on any connection
            try:
                await conn.connect()  # with the restart check (see _lifetime)
            finally:
                conn.socket_timeout = None
        packed = pack(conn, words)
        try:
            async with asyncio.timeout(self._timeout):  # type: ignore[attr-defined,unused-ignore]
                await conn.send_packed_command(packed)
                return await conn.read_response()
        except TimeoutError:  # asyncio's, on 3.11 and later
            await conn.disconnect(nowait=True)  # the reply may still come: never read it
            raise RedisTimeoutError(f"Timeout reading from {where(conn)}") from None

    @staticmethod
    async def _stale(conn: Any) -> bool:
        """True if ``conn`` has something to read before a call: a reply nobody read, or
        the server's EOF (which redis-py 8.2 and later raise as a ConnectionError)."""
        try:
            return bool(await conn.can_read())
        except (RedisConnectionError, OSError):
            return True

    async def aclose(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.conn.disconnect()


class AsyncLeaseStore:
    """The asyncio driver of the lease protocol, next to :class:`~celery_leases._store.LeaseStore`.

    It runs the same core operations (``_grants``, ``_inspect``) with ``store``'s engine, so
    the scripts, keys, owner registry and tokens are the same, and carries out their requests
    on the running loop (:meth:`run`): per-loop clients, one subscriber, shields against
    cancellation, a deadline for renewals. The leases it
    grants are :class:`~celery_leases._lease.Held` records of ``store``, so they exclude, and
    are excluded by, the sync side's. Clients are made per event loop (an asyncio connection
    belongs to its loop). Every redis error is raised as
    :class:`~celery_leases.exceptions.LeaseBackendError`.
    """

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.settings = store.settings
        self._lock = threading.Lock()
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._pid = os.getpid()

    # --- clients --------------------------------------------------------------------------
    def _state(self) -> _LoopState:
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
                client = make_async_client(self.settings, on_connect=self._connect_check())
                state = self._loops[loop] = _LoopState(
                    client=client,
                    renew_client=make_async_client(
                        self.settings, max_connections=RENEW_CONNECTIONS
                    ),
                )
                pool = getattr(client, "connection_pool", None)  # a cluster client has none
                if not self.store.cluster and pool is not None and _Lane.usable(pool):
                    state.lane = _Lane(pool, self.settings.socket_timeout)
            return state

    def _connect_check(self) -> Callable[[Any], Awaitable[None]] | None:
        """The restart check each new connection runs first (see _lifetime)."""
        cluster = parse_target(self.settings.url).kind == "cluster"
        return _lifetime.aconnect_hook(self.store.keys, self.settings, cluster=cluster)

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

    def _spawn(self, state: _LoopState, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

    async def ping(self) -> bool:
        """True if Redis answers."""
        try:
            return bool(await _shielded(self._state().client.ping()))
        except RedisError as exc:
            raise self.store.backend_error("answer PING", exc) from exc

    # --- the driver -----------------------------------------------------------------------
    async def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation on the running loop (see :meth:`LeaseStore.run`).

        Each request is sent in a task of its own (:func:`_shielded`): a cancelled caller
        gets its ``CancelledError`` at once, the request runs to its end, and the operation
        is abandoned where it stood.
        """
        state = self._state()
        return await adrive(steps, partial(self._execute, state), RedisError, failure_of)

    async def _execute(self, state: _LoopState, op: Op) -> Any:
        kind = type(op)
        # inside a task of _carry (an acquire attempt, a holder's release) the caller is
        # shielded already: a request needs no task of its own there
        bare = _SHIELD.get() is asyncio.current_task()
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
                sending = self._lane_call(state, lane, op)
                return await (sending if bare else _shielded(sending))
            if op.once:
                with one_attempt():  # the request's task inherits it
                    sending = _round_trip(state.client, op.calls, op.transaction)
                    return await (sending if bare else _shielded(sending))
            sending = _round_trip(state.client, op.calls, op.transaction)
            return await (sending if bare else _shielded(sending))
        if kind is SendReplicated:
            assert isinstance(op, SendReplicated)
            with one_attempt():
                replicated = self._evalsha_replicated(state, op.calls, renewal=False)
                return await (replicated if bare else _shielded(replicated))
        if kind is SendWithin:
            assert isinstance(op, SendWithin)
            return await self._send_within(state, op.calls, op.timeout)
        if kind is Sleep:
            assert isinstance(op, Sleep)
            await asyncio.sleep(op.seconds)
            return None
        raise TypeError(f"not a request of the lease protocol: {op!r}")

    async def _lane_call(self, state: _LoopState, lane: _Lane, op: Send) -> list[Any]:
        """One script call down ``lane``, with the pool path's outcomes (see :class:`_Lane`).

        The caller set ``lane.busy``; it is cleared here. Not ``once``: a cut connection is
        retried once on the pool's path, as redis-py's retry would.
        """
        try:
            with one_attempt():
                return [await lane.call(words_of(op.calls[0]))]
        except NoScriptError:
            once = op.once  # nothing ran: the pool's path loads the script and sends it again
        except RedisConnectionError:
            if op.once:
                raise
            once = True  # the retry, as redis-py's: one more attempt, no more
        finally:
            lane.busy = False
        if once:
            with one_attempt():
                return await _round_trip(state.client, op.calls)
        return await _round_trip(state.client, op.calls)

    # --- acquire --------------------------------------------------------------------------
    async def try_acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        task_id: str | None = None,
        ticket: _grants.Ticket | None = None,
    ) -> list[Held] | Busy:
        """One all-or-nothing attempt (see :func:`_grants.try_acquire`)."""
        return await self.run(
            _grants.try_acquire(self.store.engine, wants, ident, ttl, task_id, ticket)
        )

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
        attempt, outcome = _carry(self.try_acquire(wants, ident, ttl, task_id, ticket))
        try:
            return await outcome
        except asyncio.CancelledError:
            # also when it is done already: it may have completed just as we were cancelled
            state.tasks.add(attempt)  # aclose() waits for it, and its release
            attempt.add_done_callback(lambda done: self._release_orphan(state, done, wants, ticket))
            raise

    def _release_orphan(
        self,
        state: _LoopState,
        attempt: asyncio.Future[list[Held] | Busy | None],
        wants: Sequence[Want],
        ticket: _grants.Ticket | None,
    ) -> None:
        state.tasks.discard(attempt)
        if attempt.cancelled() or attempt.exception() is not None:
            return
        granted = attempt.result()
        engine = self.store.engine
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
        ticket = _grants.new_ticket(self.store.engine, wants, ident.owner, ttl, task_id)
        done = False
        try:
            with _grants.ordering(self.store.engine, wants, ticket):
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
                self._spawn(state, self.run(_grants.leave_queues(self.store.engine, wants, ticket)))

    async def _wait(
        self,
        state: _LoopState,
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
        keys = self.store.resource_keys
        channels = sorted({keys(w.resource).channel for w in wants})
        mine = self.store.keys.waiter_channel(ticket.id)
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
                    return _grants.handed(self.store.engine, wants, ttl, ticket, token)
                if subscriber.broken is not None:
                    subscriber.remove(channels, event)
                    subscriber = await self._subscribe(state, channels, event)
        finally:
            subscriber.remove(channels, event)

    async def _subscribe(
        self, state: _LoopState, channels: list[str], event: asyncio.Event
    ) -> _Subscriber:
        subscriber = state.subscriber
        if subscriber is None or subscriber.broken is not None:
            subscriber = state.subscriber = _Subscriber(state.client, self.settings.socket_timeout)
        try:
            await subscriber.add(channels, event)
        except RedisError as exc:
            raise self.store.backend_error("wait for a release", exc) from exc
        return subscriber

    def subscribed_channels(self) -> set[str]:
        """The release channels the running loop's subscriber listens to (for tests)."""
        state = self._loops.get(asyncio.get_running_loop())
        subscriber = None if state is None else state.subscriber
        return set() if subscriber is None else subscriber.channels()

    # --- renew ----------------------------------------------------------------------------
    async def renew(self, held: Sequence[Held], owner: str, timeout: float) -> set[int]:
        """Renew ``held`` (all of one owner) within ``timeout`` (see :func:`_grants.renew`).

        Sent on the loop's renewal client, never queued behind the requests of the loop's
        other client, under a deadline: a stalled Redis cannot hide a lost lease.

        Returns:
            the indices (into ``held``) of leases Redis no longer has for us.

        Raises:
            LeaseBackendError: Redis failed, or gave no reply within ``timeout``.
        """
        return await self.run(_grants.renew(self.store.engine, held, owner, timeout))

    async def _send_within(
        self, state: _LoopState, calls: Sequence[Script], timeout: float
    ) -> tuple[list[Any], list[Any]]:
        """The renewal's calls on the renewal client, all replies within ``timeout``.

        renew.lua is idempotent (token-checked; it only extends): the renewal client's retry
        may run it twice after a lost reply, which extends the same leases once more.
        """
        sending: asyncio.Future[tuple[list[Any], list[Any]]]
        if self.store.wait_replicas:
            sending = asyncio.ensure_future(self._evalsha_replicated(state, calls, renewal=True))
        else:
            sending = asyncio.ensure_future(_unwaited(state.renew_client, calls))
        if not await _within(sending, timeout):
            raise RedisTimeoutError(f"no reply within {timeout:.2f}s")
        return sending.result()

    # --- min_replicas ---------------------------------------------------------------------
    async def _evalsha_replicated(
        self,
        state: _LoopState,
        calls: Sequence[Script],
        *,
        renewal: bool,
    ) -> tuple[list[Any], list[Any]]:
        """EVALSHA each of ``calls``, each node's followed by ``WAIT`` on the same connection.

        Returns the replies (in the order of ``calls``) and the WAIT replies (the replicas
        that confirmed; one per node the calls went to). Off a cluster it is one round trip
        on the loop's client (``renewal``: its renewal client). On a cluster a WAIT, having no
        key, would go to any node, so the calls are grouped by the node serving their keys
        and sent on a plain client of that node, all nodes at once: each node waits for its
        own replicas. After a MOVED or ASK reply or a lost node the slot map is read again,
        so the next attempt goes to the node that serves the slot now.
        """
        wait = self.store.wait_replicas
        if not self.store.cluster:
            client = state.renew_client if renewal else state.client
            replies = await _round_trip(client, [*calls, Command(wait)])
            return replies[:-1], replies[-1:]
        routes: dict[tuple[str, int, bool], list[int]] = {}
        try:
            for i, call in enumerate(calls):
                node = await self._node_of(state, call.keys[0], renewal)
                routes.setdefault(node, []).append(i)
        except RedisConnectionError:
            await _refresh_slots(state.client)
            raise
        sent = [
            _round_trip(state.nodes[node], [*(calls[i] for i in idx), Command(wait)])
            for node, idx in routes.items()
        ]
        got = await asyncio.gather(*sent, return_exceptions=True)
        failed = [r for r in got if isinstance(r, BaseException)]
        if failed:
            # MovedError is an AskError: the slot moved (a failover, a resharding)
            if any(isinstance(r, (AskError, RedisConnectionError)) for r in failed):
                await _refresh_slots(state.client)
            raise failed[0]
        ordered: list[Any] = [None] * len(calls)
        acked: list[Any] = []
        for idx, node_replies in zip(routes.values(), got, strict=True):
            assert isinstance(node_replies, list)
            *results, count = node_replies  # the WAIT reply comes last
            for i, reply in zip(idx, results, strict=True):
                ordered[i] = reply
            acked.append(count)
        return ordered, acked

    async def _node_of(self, state: _LoopState, key: str, renewal: bool) -> tuple[str, int, bool]:
        """The node serving ``key`` in the loop's slot map; its plain client is made if new.

        The slot map is the loop's cluster client's, which a grant has read before any
        renewal on this loop (the loop's renewal client may never read one: it is not used
        with min_replicas). A renewal's node clients are apart from the grants', as the
        loop's renewal client is.
        """
        target: Any = state.client
        try:
            await target.initialize()  # reads the slot map, on first use only
            node = target.get_node_from_key(key)
        except RedisClusterException as exc:  # not a RedisError (a slot no node serves...)
            raise RedisConnectionError(f"no cluster node for {key!r}: {exc}") from exc
        name = (str(node.host), int(node.port), renewal)
        if name not in state.nodes:
            size = RENEW_CONNECTIONS if renewal else MAX_CONNECTIONS
            state.nodes[name] = _node_client(node, size, self.settings.socket_timeout)
        return name

    # --- release --------------------------------------------------------------------------
    async def release(self, held: Sequence[Held]) -> list[bool]:
        """Release ``held``; True for each lease that was still ours (as the sync store)."""
        if not held:
            return []
        return await self.run(_grants.release(self.store.engine, held, time.monotonic()))

    async def holder_task(self, resource: str) -> str | None:
        """:meth:`LeaseStore.holder_task` for asyncio: the busy path only, never raises."""
        return await self.run(_inspect.holder_task(self.store.engine, resource))

    async def lease_record(self, resource: str) -> dict[str, Any]:
        """:meth:`LeaseStore.lease_record` for asyncio."""
        return await self.run(_inspect.lease_record(self.store.engine, resource))

    async def history(
        self, *, resource: str | None = None, node: str | None = None, count: int = 50
    ) -> list[dict[str, Any]]:
        """:meth:`LeaseStore.history` for asyncio."""
        engine = self.store.engine
        return await self.run(_inspect.history(engine, resource=resource, node=node, count=count))

    # --- once receipts --------------------------------------------------------------------
    async def get_receipt(self, name: str) -> str | None:
        """The stored receipt (JSON text) of ``once(name)``, or None."""
        return await self.run(_grants.get_receipt(self.store.engine, name))

    async def commit_receipt(self, name: str, held: Held, receipt: str, ttl: float | None) -> bool:
        """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
        return await self.run(_grants.commit_receipt(self.store.engine, name, held, receipt, ttl))

    async def delete_receipt(self, name: str) -> bool:
        """Delete the receipt of ``once(name)``; True if there was one."""
        return await self.run(_grants.delete_receipt(self.store.engine, name))


async def _round_trip(
    client: aredis.Redis, calls: Sequence[Call], transaction: bool = False
) -> list[Any]:
    """One round trip of ``calls``; a script Redis lost is loaded and the calls sent again.

    The first error reply is raised.
    """
    if len(calls) == 1 and not transaction:
        call = calls[0]
        words = words_of(call)
        target: Any = client
        try:
            return [await target.execute_command(*words)]
        except NoScriptError:
            assert isinstance(call, Script)
            await client.script_load(SOURCE[call.name])
            return [await target.execute_command(*words)]
    for _ in range(2):
        pipe = client.pipeline(transaction=transaction)
        for each in calls:
            # not pipe.evalsha(): a cluster pipeline refuses it, but routes EVALSHA by its keys
            pipe.execute_command(*words_of(each))
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        if not any(isinstance(r, NoScriptError) for r in replies):
            break
        # Redis restarted or SCRIPT FLUSH ran: load the scripts and send again
        for name in {c.name for c in calls if isinstance(c, Script)}:
            await client.script_load(SOURCE[name])
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _unwaited(client: aredis.Redis, calls: Sequence[Script]) -> tuple[list[Any], list[Any]]:
    """:func:`_round_trip` without WAIT, shaped as :meth:`AsyncLeaseStore._evalsha_replicated`."""
    return await _round_trip(client, calls), []


def _node_client(node: Any, max_connections: int, timeout: float) -> aredis.Redis:
    """A plain client of one cluster node (its connection options, TLS too), not following
    MOVED: a pipeline on it keeps every command on one connection."""
    kwargs = {
        **node.connection_kwargs,  # host, port, timeouts, client name, TLS files, ...
        "retry": AsyncOnceRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    pool = aredis.BlockingConnectionPool(
        connection_class=node.connection_class,
        max_connections=max_connections,
        timeout=timeout,
        **kwargs,
    )
    return aredis.Redis.from_pool(pool)


async def _refresh_slots(cluster: aredis.Redis) -> None:
    """After a MOVED or ASK reply or a lost node: read the cluster's slot map again."""
    manager: Any = getattr(cluster, "nodes_manager", None)
    if manager is None:
        return
    with contextlib.suppress(RedisError, RedisClusterException):  # the next attempt tries again
        await manager.initialize()


#: the task :func:`_carry` made for the work running in it (each task has its own copy of
#: the context: a task made from that one inherits the value, but is not the task it names)
_SHIELD: ContextVar[asyncio.Future[Any] | None] = ContextVar("celery_leases_shield", default=None)


async def _carried(awaitable: Awaitable[T], outcome: asyncio.Future[T]) -> T | None:
    """Run ``awaitable``, and hand its outcome to ``outcome`` as it ends.

    Set from here, not from a done callback (as :func:`asyncio.shield` does): the awaiter
    wakes one turn of the loop sooner. An error is the awaiter's; the task itself then ends
    with None (nobody is left to retrieve its error when the awaiter was cancelled).
    """
    _SHIELD.set(asyncio.current_task())
    try:
        result = await awaitable
    except asyncio.CancelledError:  # the loop's shutdown: nobody else cancels this task
        if not outcome.done():
            outcome.cancel()
        raise
    except Exception as exc:
        if not outcome.done():
            outcome.set_exception(exc)
        return None
    if not outcome.done():
        outcome.set_result(result)
    return result


def _carry(awaitable: Awaitable[T]) -> tuple[asyncio.Task[T | None], asyncio.Future[T]]:
    """A task that runs ``awaitable``, and the future its awaiter waits on instead of it.

    The shield of :func:`_shielded`: a cancelled awaiter cancels the future only, the task
    runs to its end (its result: the outcome, or None after an error). It is marked, so the
    requests a store sends from inside it get no task of their own (see ``_execute``). On
    Python 3.12 and later it starts eagerly: its first step runs before this returns.
    """
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()
    carried = _carried(awaitable, outcome)
    if _EAGER:
        # it runs at once up to its first wait (the request written), not a loop turn later
        task = asyncio.Task(carried, loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]
        return task, outcome
    return loop.create_task(carried), outcome


#: tasks may start eagerly (Python 3.12)
_EAGER: Final = sys.version_info >= (3, 12)


async def _shielded(awaitable: Awaitable[T]) -> T:
    """Await a redis-py call in a task of its own, so a cancellation of the caller is never lost.

    redis-py's asyncio commands wrap their socket I/O in :func:`asyncio.wait_for`, which
    before Python 3.12 can swallow a cancellation that arrives as the I/O completes: the
    caller then runs on as if never cancelled (a cancelled waiter would go on waiting). Here
    (as under :func:`asyncio.shield`) the caller gets its ``CancelledError`` at once, and the
    call itself runs to its end (its outcome is then dropped; a grant is handled by
    ``_attempt``). The requests a store sends from inside the task get no task of their own.
    """
    _, outcome = _carry(awaitable)
    return await outcome


async def shielded(awaitable: Awaitable[T]) -> T:
    """:func:`_shielded` for the package: run a store operation (e.g. a holder's release) to
    its end even if the caller is cancelled; the caller gets its ``CancelledError`` at once."""
    return await _shielded(awaitable)


async def _within(
    awaitable: Awaitable[Any], timeout: float, undo: Callable[[], object] | None = None
) -> bool:
    """Await ``awaitable`` for up to ``timeout`` seconds; False (and it is cancelled) if late.

    Not :func:`asyncio.wait_for`: before Python 3.12 it can lose a cancellation that comes as
    the awaited thing completes (the caller then runs on as if never cancelled: a waiter keeps
    waiting, a task never ends). If the caller is cancelled or the time runs out and the
    awaited thing succeeds all the same, ``undo`` is called (e.g. to release a lock).
    """
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=max(timeout, 0.0))
    except asyncio.CancelledError:
        _abandon(future, undo)
        raise
    if done:
        future.result()  # raises its exception, if any
        return True
    _abandon(future, undo)
    return False


def _abandon(future: asyncio.Future[Any], undo: Callable[[], object] | None) -> None:
    future.cancel()  # a no-op if it is done

    def settle(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None and undo is not None:
            undo()

    future.add_done_callback(settle)
