"""The sync driver's client: made with the restart check, and its round trips.

One client per process (the store makes it anew after a fork). Its twin is
``_aio/client.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from .. import _connect, _restart_check
from .._keys import Keyspace
from .._one_attempt import OnceRetry, once_on_cluster
from .._protocol import Call, Command, Script, Send, words_of
from .._scripts import SOURCE
from ..config import LeaseSettings, safe_url
from ..exceptions import LeaseConfigError

__all__ = ("make_client", "node_of", "round_trip", "send_op")


def make_client(
    target: _connect.RedisTarget, keys: Keyspace, settings: LeaseSettings
) -> redis.Redis:
    """A client of ``target`` for ``settings``; each new connection runs the restart check.

    Raises:
        LeaseConfigError: the URL is not usable (a sync cluster client reads the slot map
            as it is made: an unreachable cluster shows here).
    """
    check = _restart_check.connect_hook(keys, settings, cluster=target.kind == "cluster")
    try:
        client = _connect.make_client(
            target,
            check,
            decode_responses=True,
            socket_timeout=settings.socket_timeout,
            socket_connect_timeout=settings.socket_connect_timeout,
            # one retry on a connection error, but none for the script calls, which
            # recover on their own (see _lostreply)
            retry=OnceRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            client_name="celery_leases",
        )
    except (ValueError, TypeError, RedisError, RedisClusterException) as exc:
        # a sync cluster client reads the slot map as it is made: an unreachable cluster,
        # or one that refuses the TLS handshake, shows here (RedisClusterException is not
        # a RedisError)
        msg = f"redis_url {safe_url(settings.url)!r} is not usable: {exc}"
        raise LeaseConfigError(msg) from None
    if _connect.is_cluster(client):
        once_on_cluster(client)  # it retries on its own, also the script calls
    return client


def node_of(client: redis.Redis, key: str, cluster: bool) -> str:
    """The name of the cluster node serving ``key`` ("" off a cluster)."""
    if not cluster:
        return ""
    node = client.get_node_from_key(key)  # type: ignore[attr-defined]
    return str(node.name)


def send_op(client: Any, op: Send) -> list[Any]:
    """One round trip of ``op``'s calls; NOSCRIPT loads the script and sends again."""
    calls = op.calls
    if len(calls) == 1 and not op.transaction:
        call = calls[0]
        if type(call) is Command:
            return [client.execute_command(*call.words)]
        assert isinstance(call, Script)
        words = words_of(call)  # on a cluster: routed by the client (off it: see the lanes)
        try:
            return [client.execute_command(*words)]
        except NoScriptError:
            client.script_load(SOURCE[call.name])
            return [client.execute_command(*words)]
    return round_trip(client, calls, transaction=op.transaction)


def round_trip(target: Any, calls: Sequence[Call], *, transaction: bool = False) -> list[Any]:
    """One round trip of ``calls`` in a pipeline of ``target``.

    If Redis lost a script (a restart, SCRIPT FLUSH), it is loaded (on every primary of
    a cluster) and the calls it refused are sent once more: those only, as the calls of a
    loaded script ran and must not run twice (a grant whose riding limit check met NOSCRIPT
    was granted twice). The first error reply is raised.
    """
    replies = _pipeline(target, calls, transaction)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        again = [calls[i] for i in missing]
        for name in {c.name for c in again if isinstance(c, Script)}:
            target.script_load(SOURCE[name])
        for i, reply in zip(missing, _pipeline(target, again, transaction), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _pipeline(target: Any, calls: Sequence[Call], transaction: bool) -> list[Any]:
    pipe = target.pipeline(transaction=transaction)
    for call in calls:
        pipe.execute_command(*words_of(call))
    return list(pipe.execute(raise_on_error=False))
