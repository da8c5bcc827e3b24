"""The asyncio driver's clients: one set per event loop, made with the restart check, and
their round trips. Its twin is ``_sync/client.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from .. import _restart_check
from .._connect import make_async_client as make_deployment_client
from .._connect import parse_target
from .._keys import Keyspace
from .._one_attempt import AsyncOnceRetry, once_on_cluster
from .._protocol import Call, Script, words_of
from .._scripts import SOURCE
from ..config import LeaseSettings, safe_url
from ..exceptions import LeaseConfigError

if TYPE_CHECKING:
    from .lanes import Lane
    from .subscriber import Subscriber

__all__ = (
    "MAX_CONNECTIONS",
    "RENEW_CONNECTIONS",
    "LoopState",
    "make_async_client",
    "restart_check",
    "round_trip",
)

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
    runs first on each new connection (the restart check: see _restart_check).
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


def restart_check(
    keys: Keyspace, settings: LeaseSettings
) -> Callable[[Any], Awaitable[None]] | None:
    """The restart check each new connection of a loop's client runs first (see
    ``_restart_check``); None when neither restart case is checked."""
    cluster = parse_target(settings.url).kind == "cluster"
    return _restart_check.aconnect_hook(keys, settings, cluster=cluster)


@dataclass
class LoopState:
    """What a store keeps per event loop: clients, scripts, subscriber, background tasks."""

    client: aredis.Redis
    renew_client: aredis.Redis
    subscriber: Subscriber | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # on a cluster with min_replicas: plain clients of single nodes, (host, port, renewal?)
    # -> client; a WAIT has no key, so it goes down the connection of the write before it
    nodes: dict[tuple[str, int, bool], aredis.Redis] = field(default_factory=dict)
    # standalone or Sentinel: the connection of single script calls (see lanes.Lane)
    lane: Lane | None = None


async def round_trip(
    client: aredis.Redis, calls: Sequence[Call], transaction: bool = False
) -> list[Any]:
    """One round trip of ``calls``; a script Redis lost is loaded and the calls it refused
    sent again (never a call that ran).

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
    replies = await _pipeline(client, calls, transaction)
    # Redis restarted or SCRIPT FLUSH ran: load the scripts it refused and send those calls
    # again, those only (the calls of a loaded script ran: see _sync/client.round_trip)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        again = [calls[i] for i in missing]
        for name in {c.name for c in again if isinstance(c, Script)}:
            await client.script_load(SOURCE[name])
        for i, reply in zip(missing, await _pipeline(client, again, transaction), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _pipeline(client: aredis.Redis, calls: Sequence[Call], transaction: bool) -> list[Any]:
    pipe = client.pipeline(transaction=transaction)
    for each in calls:
        # not pipe.evalsha(): a cluster pipeline refuses it, but routes EVALSHA by its keys
        pipe.execute_command(*words_of(each))
    return list(await pipe.execute(raise_on_error=False))
