"""Subscriber: one event loop's pub/sub connection, waking the coroutines that wait for a
release. Its twin is ``_sync/subscriber.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._protocol import Heard, Listen, Op
from .._wire import handoff
from .shields import shielded, within

if TYPE_CHECKING:
    from .client import LoopState

__all__ = ("Abandoned", "Listening", "Subscriber")


class Subscriber:
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
            await shielded(self._apply())
            end = time.monotonic() + self._timeout
            for channel in channels:
                ready = self._ready.get(channel)
                if ready is None:  # broken meanwhile
                    break
                if not ready.is_set() and not await within(ready.wait(), end - time.monotonic()):
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


class Abandoned(Exception):
    """The caller of a wait went away: its :class:`Listening` listens no more."""


class Listening:
    """One wait's listening on its loop's :class:`Subscriber` (see ``AsyncLeaseStore.run_wait``);
    the twin of ``_sync/subscriber.py::Listening``.

    It registers one event for the wait's channels at its first Listen, and keeps it to the
    end of the wait; a subscriber that broke is replaced and subscribed to again before the
    next attempt. Once the caller went away, a listen under way ends and none is made.
    """

    def __init__(
        self, state: LoopState, send: Callable[[Op], Awaitable[Any]], confirm_timeout: float
    ) -> None:
        self._state, self._send, self._timeout = state, send, confirm_timeout
        self._subscriber: Subscriber | None = None
        self._channels: Sequence[str] = ()
        self._event = asyncio.Event()
        #: what the wait's caller awaits: cancelled when the caller went away
        self.caller: asyncio.Future[Any] | None = None

    @property
    def abandoned(self) -> bool:
        """The caller went away: a listen under way ends (:meth:`wake`), and none is made."""
        return self.caller is not None and self.caller.cancelled()

    def wake(self) -> None:
        """End a listen under way."""
        self._event.set()

    async def execute(self, op: Op) -> Any:
        """Carry out ``op``: a Listen here, any other request by the store."""
        if type(op) is Listen:
            return await self.listen(op)
        return await self._send(op)

    async def listen(self, op: Listen) -> Heard:
        subscriber, event = self._subscriber, self._event
        if subscriber is None:
            self._channels = op.channels
            subscriber = await self._subscribe()
        if op.timeout > 0 and not self.abandoned:
            # woken by a release, or by the blocking holder's expiry at the latest
            timer = asyncio.get_running_loop().call_later(op.timeout, event.set)
            try:
                await event.wait()
            finally:
                timer.cancel()
        event.clear()  # before the next attempt: a release from now on wakes us
        if self.abandoned:
            raise Abandoned
        token = subscriber.handed.pop(op.handed_on, None) if op.handed_on else None
        if token is None and subscriber.broken is not None:
            subscriber.remove(self._channels, event)
            await self._subscribe()
        return Heard(token)

    async def _subscribe(self) -> Subscriber:
        state = self._state
        subscriber = state.subscriber
        if subscriber is None or subscriber.broken is not None:
            subscriber = state.subscriber = Subscriber(state.client, self._timeout)
        await subscriber.add(self._channels, self._event)
        self._subscriber = subscriber
        return subscriber

    def close(self) -> None:
        """Stop listening (never waits: the UNSUBSCRIBE goes in a task of its own)."""
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            subscriber.remove(self._channels, self._event)
