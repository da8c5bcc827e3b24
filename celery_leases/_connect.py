"""Which Redis a URL names, and the redis-py client for it.

Three deployments, told apart by the URL's scheme (docs/redis.md lists the exact forms):

- one server: ``redis://``, ``rediss://`` (TLS) and ``unix://``, as redis-py reads them;
- a master found through Redis Sentinel: ``sentinel://`` with every sentinel's address and the
  master's name, ``sentinel://[user:password@]host:port[,host:port...][/db]?master_name=NAME``
  (Celery's ``;``-joined form, ``sentinel://h1:26379;sentinel://h2:26379``, is read too).
  ``ssl=true`` turns TLS on to the master and replicas, ``sentinel_ssl=true`` to the sentinels;
  the ``ssl_*`` options serve both, a ``sentinel_ssl_*`` option replaces one for the sentinels;
- a Redis Cluster: ``redis+cluster://`` or ``rediss+cluster://`` with one or more seed nodes,
  ``redis+cluster://[user:password@]host:port[,host:port...]``.

Everything else in the URL (the password, the database, TLS files, timeouts) is read by
redis-py's own URL parser, so a query argument means the same in every form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.sentinel import Sentinel

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = (
    "RedisTarget",
    "aclose_client",
    "is_cluster",
    "make_async_client",
    "make_client",
    "parse_target",
)

Kind = Literal["single", "sentinel", "cluster"]

SINGLE_SCHEMES: Final = ("redis", "rediss", "unix")
CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEME: Final = "sentinel"
#: query arguments of a sentinel:// URL that are about the sentinels, not the master
_SENTINEL_ARGS: Final = ("master_name", "sentinel_username", "sentinel_password")
#: the prefix of a TLS option for the sentinels only (``sentinel_ssl_ca_certs=...``)
SENTINEL_SSL_PREFIX: Final = "sentinel_ssl_"
_TRUE: Final = ("true", "yes", "1")
_FALSE: Final = ("false", "no", "0")
_CONNECTION_ONLY: Final = ("host", "port", "connection_class", "path")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed lease URL: the deployment kind, the addresses, and the connection options."""

    kind: Kind
    url: str
    #: sentinels (sentinel) or seed nodes (cluster); empty for one server
    hosts: tuple[tuple[str, int], ...] = ()
    master_name: str | None = None
    #: connection keyword arguments as redis-py's URL parser gives them (password, db, ssl...)
    options: dict[str, Any] = field(default_factory=dict)
    #: keyword arguments for the connections to the sentinels themselves
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def parse_target(url: str) -> RedisTarget:
    """Read ``url``.

    Raises:
        ValueError: the URL is not one of the forms above; the message says what is wrong.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in SINGLE_SCHEMES:
        return RedisTarget("single", url, options=_redis_py_options(url))
    if scheme in CLUSTER_SCHEMES:
        return _parse_cluster(url, CLUSTER_SCHEMES[scheme])
    if scheme == SENTINEL_SCHEME:
        return _parse_sentinel(url)
    msg = (
        "must be a redis://, rediss:// or unix:// URL (one server), sentinel:// "
        "(a master found through Redis Sentinel) or redis+cluster:// / rediss+cluster:// "
        "(a Redis Cluster)"
    )
    raise ValueError(msg)


def _redis_py_options(url: str) -> dict[str, Any]:
    try:
        return dict(parse_url(url))  # type: ignore[no-untyped-call, unused-ignore]
    except ValueError as exc:
        if "Port" in str(exc):  # urllib's message quotes the port, which may be a password piece
            msg = "its port is not a number (percent-encode / ? # @ in a password)"
            raise ValueError(msg) from None
        raise ValueError(f"redis-py cannot read it: {exc}") from None


def _hosts(netloc: str, default_port: int, what: str) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for item in netloc.rsplit("@", 1)[-1].split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"has an empty {what} address")
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":")
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"has a {what} address with a bad port: {item!r}") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"has a bad {what} address: {item!r}")
        hosts.append((host, port))
    return tuple(hosts)


def _single_form(scheme: str, netloc: str, path: str, query: str) -> str:
    """A redis:// URL with the user info, path and query of ``netloc``/``path``/``query``."""
    userinfo = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
    return urlunsplit((scheme, f"{userinfo}placeholder", path, query, ""))


def _connection_options(url: str) -> dict[str, Any]:
    options = _redis_py_options(url)
    for key in _CONNECTION_ONLY:
        options.pop(key, None)
    return options


def _parse_cluster(url: str, base_scheme: str) -> RedisTarget:
    parts = urlsplit(url)
    hosts = _hosts(parts.netloc, 6379, "cluster node")
    options = _connection_options(_single_form(base_scheme, parts.netloc, parts.path, parts.query))
    if options.pop("db", 0) != 0:
        raise ValueError("names a database other than 0; a Redis Cluster has only database 0")
    if base_scheme == "rediss":
        options["ssl"] = True
    return RedisTarget("cluster", url, hosts=hosts, options=options)


def _parse_sentinel(url: str) -> RedisTarget:
    pieces = [p for p in url.split(";") if p.strip()]
    hosts: list[tuple[str, int]] = []
    netloc = path = ""
    query: list[tuple[str, str]] = []
    for piece in pieces:
        if not piece.lower().startswith(SENTINEL_SCHEME + "://"):
            shown = piece.split("@")[-1]
            raise ValueError(f"joins a URL that is not sentinel:// with ';': {shown!r}")
        parts = urlsplit(piece)
        hosts += _hosts(parts.netloc, 26379, "sentinel")
        # Celery's form repeats the user info, database and options in each part
        if "@" in parts.netloc and "@" not in netloc:
            netloc = parts.netloc
        path = path or parts.path
        query += parse_qsl(parts.query)
    args = dict(query)
    master_name = args.pop("master_name", "").strip()
    if not master_name:
        msg = "needs the master's name: add ?master_name=<name> (as configured in the sentinels)"
        raise ValueError(msg)
    master_tls = _flag(args, "ssl")
    sentinel_tls = _flag(args, "sentinel_ssl")
    sentinel_options: dict[str, Any] = {}
    for key in ("sentinel_username", "sentinel_password"):
        if key in args:
            sentinel_options[key.removeprefix("sentinel_")] = args.pop(key)
    sentinel_only = {
        k.removeprefix("sentinel_"): args.pop(k)
        for k in list(args)
        if k.startswith(SENTINEL_SSL_PREFIX)
    }
    shared_tls = {k: v for k, v in args.items() if k.startswith("ssl_")}
    if shared_tls and not (master_tls or sentinel_tls):
        msg = (
            f"has TLS options ({', '.join(sorted(shared_tls))}) but no TLS: add ssl=true (TLS to "
            "the master and replicas) and/or sentinel_ssl=true (TLS to the sentinels)"
        )
        raise ValueError(msg)
    if sentinel_only and not sentinel_tls:
        names = ", ".join(sorted("sentinel_" + k for k in sentinel_only))
        raise ValueError(f"has TLS options for the sentinels ({names}) without sentinel_ssl=true")
    if sentinel_tls:
        tls_query = urlencode({**shared_tls, **sentinel_only})
        tls = _connection_options(_single_form("rediss", "", "", tls_query))
        sentinel_options.update(tls, ssl=True)
    if not master_tls:
        for key in shared_tls:  # they were for the sentinels only
            del args[key]
    scheme = "rediss" if master_tls else "redis"
    options = _connection_options(_single_form(scheme, netloc, path, urlencode(args)))
    if master_tls:
        options["ssl"] = True
    return RedisTarget(
        "sentinel",
        url,
        hosts=tuple(hosts),
        master_name=master_name,
        options=options,
        sentinel_options=sentinel_options,
    )


def _flag(args: dict[str, str], name: str) -> bool:
    """Pop the yes/no query argument ``name`` of ``args`` (absent: no)."""
    value = args.pop(name, "false").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"has {name}={value!r}; write {name}=true or {name}=false")


def make_client(
    target: RedisTarget, on_connect: Callable[[Any], None] | None = None, **common: Any
) -> redis.Redis:
    """The client for ``target``; ``common`` are the store's own options (timeouts, name...).

    A :class:`~redis.cluster.RedisCluster` is returned typed as :class:`redis.Redis`: the store
    calls only commands both have (scripts on keys of one slot, pipelines, pub/sub).
    ``on_connect(connection)`` runs on every new data connection before anything else is sent
    on it (after redis-py's own connect step on a cluster; instead of it elsewhere, so it
    must call ``connection.on_connect()`` first: see ``_restart_check.ConnectCheck``).
    """
    if on_connect is not None:
        common = {**common, "redis_connect_func": on_connect}
    client = _build(target, common, redis.Redis.from_url, RedisCluster, ClusterNode, Sentinel)
    return cast("redis.Redis", client)


def make_async_client(
    target: RedisTarget,
    on_connect: Callable[[Any], Awaitable[None]] | None = None,
    **common: Any,
) -> redis.asyncio.Redis:
    """The asyncio client for ``target``: the same deployments and options as
    :func:`make_client`, on ``redis.asyncio`` (a cluster client typed as the plain one too).
    ``on_connect`` runs instead of redis-py's connect step on every topology."""
    if on_connect is not None and target.kind != "cluster":
        common = {**common, "redis_connect_func": on_connect}
    client = _build(
        target,
        common,
        redis.asyncio.Redis.from_url,
        AsyncRedisCluster,
        AsyncClusterNode,
        AsyncSentinel,
    )
    if on_connect is not None and target.kind == "cluster":
        # the asyncio cluster client takes no redis_connect_func: give it to the nodes it
        # made from the seeds and to those it will find (their connections are made lazily)
        client.nodes_manager.connection_kwargs["redis_connect_func"] = on_connect
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_kwargs["redis_connect_func"] = on_connect
    return cast("redis.asyncio.Redis", client)


def _build(
    target: RedisTarget,
    common: dict[str, Any],
    from_url: Callable[..., Any],
    cluster_class: Callable[..., Any],
    node_class: Callable[..., Any],
    sentinel_class: Callable[..., Any],
) -> Any:
    """The client of ``target`` from one family of redis-py classes (sync or asyncio)."""
    if target.kind == "single":
        return from_url(target.url, **common)
    options = {**target.options, **common}
    if target.kind == "cluster":
        # the cluster client retries MOVED/ASK and refreshes its slot map itself
        options.pop("retry", None)
        nodes = [node_class(host, port) for host, port in target.hosts]
        return cluster_class(startup_nodes=nodes, **options)
    # The sentinels' connections get the store's timeouts and retry policy too: redis-py's
    # default retries each sentinel three times with backoff (about 20 s before a call fails
    # when no sentinel answers), and a sentinel that does not answer is skipped for the next
    # one anyway.
    timeouts = {k: common[k] for k in ("socket_timeout", "socket_connect_timeout") if k in common}
    retry = {"retry": common["retry"]} if "retry" in common else {}
    sentinel = sentinel_class(
        list(target.hosts),
        sentinel_kwargs={**timeouts, **retry, **target.sentinel_options},
        **timeouts,
    )
    assert target.master_name is not None
    return sentinel.master_for(target.master_name, **options)


async def aclose_client(client: redis.asyncio.Redis) -> None:
    """Close an asyncio client from :func:`make_async_client`, its sentinels' connections too
    (closing the master's client leaves the connections that found the master open)."""
    await client.aclose()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()


def is_cluster(client: object) -> bool:
    """True when ``client`` talks to a Redis Cluster (sync or asyncio)."""
    return isinstance(client, (RedisCluster, AsyncRedisCluster))
