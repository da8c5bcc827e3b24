"""RenewalLines: the sync renewal's own connections, with a deadline per call.

redis-py applies one socket timeout to every command of a connection; the heartbeat needs a
deadline per call instead (the time left before its first lease would count as lost), so
the sync driver sends a renewal (:class:`~celery_leases._protocol.SendWithin`) on
connections of its own, driven directly: one for one server or a Sentinel master, one per
node on a cluster. The asyncio driver's renewal client does the same with a timer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .._protocol import Script, words_of
from .._scripts import SOURCE
from .client import node_of

if TYPE_CHECKING:
    import redis

    from .._engine import LeaseEngine

__all__ = ("RenewalLines",)


class RenewalLines:
    """A store's renewal connections in this process (made anew after a fork).

    ``client``: the store's client of this process, whose pools (one per cluster node) the
    renewal connections copy their options from.
    """

    def __init__(self, engine: LeaseEngine, client: Callable[[], redis.Redis]) -> None:
        self._engine = engine
        self._client = client
        self._lock = threading.Lock()
        # see _connection: node name ("" off a cluster) -> connection, in _pid
        self._conns: dict[str, Any] = {}
        self._pid = -1

    def close(self) -> None:
        """Close this process's renewal connections."""
        conns, self._conns = self._conns, {}
        if self._pid == os.getpid():
            for conn in conns.values():
                conn.disconnect()

    def send(self, calls: Sequence[Script], timeout: float) -> tuple[list[Any], list[Any]]:
        """EVALSHA each of ``calls`` within ``timeout``: one round trip per Redis node.

        redis-py applies one socket timeout to every command of a connection; the heartbeat
        needs a deadline per call instead, so it drives connections of its own directly: one
        for one server or a Sentinel master, one per node on a cluster (each call's keys
        share one slot, so its first key says which node). Returns the replies and, with
        min_replicas, each node's WAIT reply.
        """
        end = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise RedisTimeoutError(f"another renewal still runs after {timeout:.2f}s")
        try:
            routes: dict[str, list[int]] = {}
            for i, call in enumerate(calls):
                key = call.keys[0]
                routes.setdefault(node_of(self._client(), key, self._engine.cluster), []).append(i)
            conns = {
                node: self._connection(node, max(0.0, end - time.monotonic())) for node in routes
            }
            replies: list[Any] = [None] * len(calls)
            acked: list[Any] = []
            try:
                # every node gets its commands before any reply is read
                for node, idx in routes.items():
                    self._send(conns[node], [calls[i] for i in idx])
                for node, idx in routes.items():
                    got, count = self._read(conns[node], [calls[i] for i in idx], end)
                    for i, reply in zip(idx, got, strict=True):
                        replies[i] = reply
                    if count is not None:
                        acked.append(count)
            except BaseException as exc:
                for conn in conns.values():
                    conn.disconnect()
                if self._engine.cluster and isinstance(exc, (MovedError, RedisConnectionError)):
                    self._refresh_slots()
                raise
            return replies, acked
        finally:
            self._lock.release()

    def _refresh_slots(self) -> None:
        """After a MOVED reply or a lost node: read the cluster's slot map again."""
        with suppress(RedisError):  # the next renewal tries again
            self._client().nodes_manager.initialize()  # type: ignore[attr-defined]

    def _connection(self, node: str, timeout: float) -> Any:
        """This process's renewal connection to ``node``, opened (if it is not) within ``timeout``.

        Not a pooled one: t0 Redis freezes while every pooled connection is in use; t1 the
        renewal needs a new connection, and redis-py's handshake (CLIENT SETNAME, ...) waits
        for the full socket timeout; t2 the lease's deadline passes unnoticed; t3 Redis
        expires the lease and hands it on, and only then is the holder told. Its own
        connection, opened with the renewal's deadline as its timeouts, cannot stall so.
        Under Sentinel it asks the sentinels for the master each time it (re)connects.
        """
        pid = os.getpid()
        if self._pid != pid:
            self._conns, self._pid = {}, pid
        conn = self._conns.get(node)
        if conn is None:
            if self._engine.cluster:
                cluster_node = self._client().get_node(node_name=node)  # type: ignore[attr-defined]
                pool = self._client().get_redis_connection(cluster_node).connection_pool  # type: ignore[attr-defined]
            else:
                pool = self._client().connection_pool
            kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
            conn = self._conns[node] = pool.connection_class(**kwargs)
        if getattr(conn, "_sock", None) is None:
            conn.socket_connect_timeout = conn.socket_timeout = max(timeout, 0.001)
            conn.connect()
        return conn

    def _send(self, conn: Any, calls: Sequence[Script]) -> None:
        commands: list[tuple[Any, ...]] = [words_of(call) for call in calls]
        if self._engine.wait_replicas:
            commands.append(self._engine.wait_replicas)
        conn.send_packed_command(conn.pack_commands(commands))

    def _read(self, conn: Any, calls: Sequence[Script], end: float) -> tuple[list[Any], Any]:
        """The replies to what :meth:`_send` sent ``conn``, each by ``end`` (monotonic), and
        the WAIT reply (None without min_replicas)."""
        replies = [self._read_one(conn, end) for _ in calls]
        acked = self._read_one(conn, end) if self._engine.wait_replicas else None
        if any(isinstance(r, NoScriptError) for r in replies):
            # Redis restarted or SCRIPT FLUSH ran: load it and send again, same deadline
            for name in {call.name for call in calls}:
                conn.send_command("SCRIPT", "LOAD", SOURCE[name])
                self._read_one(conn, end)
            self._send(conn, calls)
            return self._read(conn, calls, end)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies, acked

    @staticmethod
    def _read_one(conn: Any, end: float) -> Any:
        left = end - time.monotonic()
        if left <= 0 or not conn.can_read(timeout=left):
            raise RedisTimeoutError("no reply before the renewal's deadline")
        try:
            return conn.read_response()
        except NoScriptError as exc:
            return exc  # the other replies must still be read off the connection
