"""Subscribers: the sync driver's subscriber connections, and a wait for a release on them.

A waiter subscribes to the release channels of what it wants, then tries again; it is woken
by a release at once (no polling), and by the blocking holder's expiry at the latest. Waiters
keep their connections: opening one costs redis-py's handshake (several round trips), which
a waiter would otherwise pay on every wait. (The asyncio driver has one subscriber per
event loop, ``_astore._Subscriber``.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final

import redis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ("Subscribers",)

#: idle subscriber connections a store keeps per process for waiters
IDLE_SUBSCRIBERS: Final = 4


class Subscribers:
    """A store's idle subscriber connections in this process (dropped after a fork)."""

    def __init__(self, client: Callable[[], redis.Redis], confirm_timeout: float) -> None:
        self._client = client
        self._confirm_timeout = confirm_timeout
        self._lock = threading.Lock()
        self._idle: list[redis.client.PubSub] = []
        self._pid = os.getpid()

    def wait(self, channels: list[str], attempt: Callable[[], float | None]) -> None:
        """Subscribe to ``channels``, then call ``attempt`` until it returns None.

        Any other return is how many seconds to wait for a message before the next attempt
        (a release, or the blocking holder's expiry at the latest; a message of an earlier
        wait on this connection costs one extra attempt). Raises redis errors.
        """
        pubsub = self._take()
        healthy = False
        try:
            pubsub.subscribe(*channels)
            self._await_subscribed(pubsub, channels)
            while (pause := attempt()) is not None:
                pubsub.get_message(timeout=pause)
            healthy = True
        finally:
            if healthy:
                self._give_back(pubsub, channels)
            else:
                pubsub.close()

    def close(self) -> None:
        """Close this process's idle subscriber connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for pubsub in idle:
                pubsub.close()

    def _take(self) -> redis.client.PubSub:
        """An idle subscriber connection of this process, or a new one.

        Waiters keep their connections: opening one costs redis-py's handshake (several round
        trips), which a waiter would otherwise pay on every wait.
        """
        client = self._client()
        with self._lock:
            if self._pid == os.getpid() and self._idle:
                return self._idle.pop()
        pubsub: redis.client.PubSub = client.pubsub()  # type: ignore[no-untyped-call]
        return pubsub

    def _give_back(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        # UNSUBSCRIBE is sent, not waited for: its confirmations (and any late message) are
        # skipped by the next waiter's _await_subscribed
        try:
            pubsub.unsubscribe(*channels)  # type: ignore[no-untyped-call]
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
