"""WAIT routing (min_replicas) for the sync driver: each node's writes, then its ``WAIT``.

A ``WAIT`` has no key: it counts the replicas of the writes made on its own connection, so
it must go down the connection of the writes before it. Its twin is ``_aio/replicated.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from .._engine import LeaseEngine
from .._protocol import Command, Script
from .client import node_of, round_trip

__all__ = ("send_replicated",)


def send_replicated(
    client: redis.Redis, engine: LeaseEngine, calls: Sequence[Script]
) -> tuple[list[Any], list[Any]]:
    """Each node's calls then ``WAIT`` on one connection, in one round trip per node.

    Returns the replies (in the order of ``calls``) and the WAIT replies (one per node).
    """
    routes: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        routes.setdefault(node_of(client, call.keys[0], engine.cluster), []).append(i)
    replies: list[Any] = [None] * len(calls)
    acked: list[Any] = []
    wait = Command(engine.wait_replicas)
    for node, idx in routes.items():
        target: Any = client
        if engine.cluster:  # WAIT must go down the same connection as the writes
            target = target.get_redis_connection(target.get_node(node_name=node))
        *got, count = round_trip(target, [*(calls[i] for i in idx), wait])
        for i, reply in zip(idx, got, strict=True):
            replies[i] = reply
        acked.append(count)
    return replies, acked
