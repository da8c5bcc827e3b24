"""WAIT routing (min_replicas) for the asyncio driver: each node's writes, then its ``WAIT``.

A ``WAIT`` has no key: it counts the replicas of the writes made on its own connection, so
it must go down the connection of the writes before it. Its twin is ``_sync/replicated.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from .._engine import LeaseEngine
from .._one_attempt import AsyncOnceRetry
from .._protocol import Command, Script
from .client import MAX_CONNECTIONS, RENEW_CONNECTIONS, LoopState, round_trip

__all__ = ("refresh_slots", "send_replicated")


async def send_replicated(
    state: LoopState,
    engine: LeaseEngine,
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
    wait = engine.wait_replicas
    if not engine.cluster:
        client = state.renew_client if renewal else state.client
        replies = await round_trip(client, [*calls, Command(wait)])
        return replies[:-1], replies[-1:]
    routes: dict[tuple[str, int, bool], list[int]] = {}
    try:
        for i, call in enumerate(calls):
            node = await _node_of(state, call.keys[0], renewal, engine.settings.socket_timeout)
            routes.setdefault(node, []).append(i)
    except RedisConnectionError:
        await refresh_slots(state.client)
        raise
    sent = [
        round_trip(state.nodes[node], [*(calls[i] for i in idx), Command(wait)])
        for node, idx in routes.items()
    ]
    got = await asyncio.gather(*sent, return_exceptions=True)
    failed = [r for r in got if isinstance(r, BaseException)]
    if failed:
        # MovedError is an AskError: the slot moved (a failover, a resharding)
        if any(isinstance(r, (AskError, RedisConnectionError)) for r in failed):
            await refresh_slots(state.client)
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


async def _node_of(
    state: LoopState, key: str, renewal: bool, timeout: float
) -> tuple[str, int, bool]:
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
        state.nodes[name] = _node_client(node, size, timeout)
    return name


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


async def refresh_slots(cluster: aredis.Redis) -> None:
    """After a MOVED or ASK reply or a lost node: read the cluster's slot map again."""
    manager: Any = getattr(cluster, "nodes_manager", None)
    if manager is None:
        return
    with contextlib.suppress(RedisError, RedisClusterException):  # the next attempt tries again
        await manager.initialize()
