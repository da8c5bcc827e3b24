"""Lane: one event loop's connection of its own for single script calls (the hot path).

Its twin is ``_sync/lanes.py`` (there, one lane per thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._one_attempt import one_attempt
from .._protocol import Send, words_of
from .._wire import pack, where
from .client import round_trip

__all__ = ("Lane",)


class Lane:
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
                await conn.connect()  # with the restart check (see _restart_check)
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

    async def send(self, client: aredis.Redis, op: Send) -> list[Any]:
        """One script call down the lane, with the pool path's outcomes (see :class:`Lane`).

        The caller set ``busy``; it is cleared here. Not ``once``: a cut connection is
        retried once on the pool's path, as redis-py's retry would.
        """
        try:
            with one_attempt():
                return [await self.call(words_of(op.calls[0]))]
        except NoScriptError:
            once = op.once  # nothing ran: the pool's path loads the script and sends it again
        except RedisConnectionError:
            if op.once:
                raise
            once = True  # the retry, as redis-py's: one more attempt, no more
        finally:
            self.busy = False
        if once:
            with one_attempt():
                return await round_trip(client, op.calls)
        return await round_trip(client, op.calls)

    async def aclose(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.conn.disconnect()
