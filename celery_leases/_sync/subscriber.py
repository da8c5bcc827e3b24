"""Subscriber: the sync driver's subscriber connections, and a wait's listening on them.

A wait (``_wait``) subscribes to the release channels of what it wants, then tries again; it
is woken by a release at once (no polling), and by the blocking holder's expiry at the
latest. Each :class:`~celery_leases._protocol.Listen` it yields is carried out by its
:class:`Listening`. Waiters
keep their connections: opening one costs redis-py's handshake (several round trips), which
a waiter would otherwise pay on every wait. (The asyncio driver has one subscriber per
event loop, its twin ``_aio/subscriber.py::Subscriber``.)

A wake-up is read off the socket directly where it is a plain one read with hiredis
(``lanes.skip_replies``): each message only says "try again", and redis-py's
``get_message`` costs about 37 µs a message on the benchmark VM.

A waiter that got its grant hands its connection to a returner thread, which sends the
UNSUBSCRIBE and puts the connection back among the idle ones: the waiter's caller runs on at
once. On this VM that write and redis-py's pub/sub path around it cost about 0.3 ms, a sixth
of a handoff (docs/benchmarks.md, part (b)). It is not skipped: left subscribed, an idle
connection would receive every later release of those resources.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._protocol import Heard, Listen, Op
from .._wire import handoff
from .lanes import direct_parser, skip_replies

__all__ = ("Listening", "Subscriber")

#: idle subscriber connections a store keeps per process for waiters
IDLE_SUBSCRIBERS: Final = 4


class Subscriber:
    """A store's idle subscriber connections in this process (dropped after a fork)."""

    def __init__(self, client: Callable[[], redis.Redis], confirm_timeout: float) -> None:
        self._client = client
        self._confirm_timeout = confirm_timeout
        self._lock = threading.Lock()
        self._idle: list[redis.client.PubSub] = []
        self._pid = os.getpid()
        # the thread that sends the UNSUBSCRIBE of waiters that are done (None: not started
        # in this process; a forked child starts its own)
        self._returner: _Returner | None = None

    def listening(self, send: Callable[[Op], Any]) -> Listening:
        """A wait's subscription on one of these connections (see :class:`Listening`); its
        other requests go to ``send``."""
        return Listening(self, send)

    def close(self) -> None:
        """Close this process's idle subscriber connections, once its returner thread has
        given back what it was handed."""
        with self._lock:
            returner, self._returner = self._returner, None
        if returner is not None and returner.pid == os.getpid():
            returner.stop(self._confirm_timeout)
        with self._lock:
            idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for pubsub in idle:
                pubsub.close()

    def _give_back_later(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        """Hand ``pubsub`` to the returner thread (started on first use in this process)."""
        with self._lock:
            returner = self._returner
            if returner is None or returner.pid != os.getpid():
                returner = self._returner = _Returner(self._give_back)
        returner.put((pubsub, channels))

    def _take(self) -> redis.client.PubSub:
        """An idle subscriber connection of this process, or a new one.

        Waiters keep their connections: opening one costs redis-py's handshake (several round
        trips), which a waiter would otherwise pay on every wait.
        """
        client = self._client()
        with self._lock:
            if self._pid == os.getpid() and self._idle:
                return self._idle.pop()
        pubsub: redis.client.PubSub = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
        return pubsub

    def _give_back(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        # UNSUBSCRIBE is sent, not waited for: its confirmations (and any late message) are
        # skipped by the next waiter's _await_subscribed
        try:
            pubsub.unsubscribe(*channels)  # type: ignore[no-untyped-call, unused-ignore]
        except RedisError:
            pubsub.close()
            return
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            if len(self._idle) < IDLE_SUBSCRIBERS:
                self._idle.append(pubsub)
                return
        pubsub.close()

    def _await_subscribed(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        # The subscription must be in force before the next attempt: a release that comes
        # between a failed attempt and a late SUBSCRIBE would otherwise go unheard.
        deadline = time.monotonic() + self._confirm_timeout
        waiting = set(channels)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RedisTimeoutError("no SUBSCRIBE confirmation")
            message = pubsub.get_message(timeout=left)
            if message is not None and message.get("type") == "subscribe":
                waiting.discard(str(message.get("channel")))


class Listening:
    """One wait's subscription: made at its first :class:`~celery_leases._protocol.Listen`,
    kept to the end of the wait, then handed to the returner (or closed after a failure).

    A context manager: ``with subscribers.listening(send) as listening: ...``, each request of
    the wait given to :meth:`execute`.
    """

    __slots__ = ("_channels", "_clean", "_parser", "_pubsub", "_send", "_subscribers")

    def __init__(self, subscribers: Subscriber, send: Callable[[Op], Any]) -> None:
        self._subscribers, self._send = subscribers, send
        self._pubsub: redis.client.PubSub | None = None
        self._channels: list[str] = []
        self._parser: object | None = None
        #: the connection's last read ended where it should: it may serve another wait
        self._clean = False

    def __enter__(self) -> Listening:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is None:
            return
        # a wait that ends with an error raised outside a listen (LeaseBusy at its timeout, a
        # failed attempt on another connection) leaves this one as good as a grant does; an
        # error in the middle of a listen may leave a reply half read: that one is closed
        if self._clean:
            self._subscribers._give_back_later(pubsub, self._channels)
        else:
            pubsub.close()

    def execute(self, op: Op) -> Any:
        """Carry out ``op``: a Listen here, any other request by ``send``."""
        return self.listen(op) if type(op) is Listen else self._send(op)

    def listen(self, op: Listen) -> Heard:
        """Subscribe to ``op.channels`` (at the wait's first listen), then wait up to
        ``op.timeout`` for a message (a release, or a handoff on ``op.handed_on``). A
        message of an earlier wait on this connection costs one extra attempt. Raises redis
        errors."""
        self._clean = False
        pubsub = self._pubsub
        if pubsub is None:
            pubsub = self._subscribers._take()
            self._pubsub, self._channels = pubsub, list(op.channels)
            pubsub.subscribe(*self._channels)
            self._subscribers._await_subscribed(pubsub, self._channels)
            self._parser = direct_parser(pubsub.connection)
        token = None
        # every message but a handoff says "try again": read past redis-py's pub/sub
        # machinery where the socket allows it. The confirmations of this wait's SUBSCRIBE
        # were read by _await_subscribed, and those of the UNSUBSCRIBE of an earlier wait on
        # this connection came before them, so only messages are left.
        if self._parser is not None:
            try:
                token = skip_replies(pubsub.connection, self._parser, op.timeout, op.handed_on)
                self._clean = True
                return Heard(token)
            except RedisConnectionError:
                # killed, or the server restarted: redis-py's path from here on, which
                # connects again and subscribes again
                self._parser = None
        message = pubsub.get_message(timeout=op.timeout)
        if message is not None and op.handed_on is not None:
            kind, channel = message.get("type"), message.get("channel")
            token = handoff(kind, channel, message.get("data"), op.handed_on)
        self._clean = True
        return Heard(token)


class _Returner:
    """A thread that gives back the connections of waiters that are done (see the module
    docstring), in the order they were handed to it, until stopped.

    Made of threading's lock and condition, which eventlet and gevent turn green, so a
    green worker's returner waits without blocking the hub.
    """

    def __init__(self, give_back: Callable[[redis.client.PubSub, list[str]], None]) -> None:
        self.pid = os.getpid()
        self._give_back = give_back
        self._ready = threading.Condition()
        self._items: deque[tuple[redis.client.PubSub, list[str]] | None] = deque()
        self._thread = threading.Thread(
            target=self._run, name="celery-leases-unsubscriber", daemon=True
        )
        self._thread.start()

    def put(self, item: tuple[redis.client.PubSub, list[str]] | None) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def stop(self, timeout: float) -> None:
        """Give back what was handed so far, then end (waits up to ``timeout`` seconds)."""
        self.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items:
                    self._ready.wait()
                item = self._items.popleft()
            if item is None:
                return
            pubsub, channels = item
            try:
                self._give_back(pubsub, channels)
            except Exception:  # one connection's trouble must not stop the others' return
                pubsub.close()
