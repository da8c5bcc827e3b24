"""Fenced writes: a Redis store that refuses a write from a holder older than the last one.

A lease cannot stop a holder that was frozen past its TTL (a GC pause, SIGSTOP, a VM
migration) from writing after the next holder was granted: only the store can refuse that
write. Each grant carries a fencing token (:attr:`Lease.token <celery_leases.Lease.token>`)
larger than every earlier token of its resource; a fenced store keeps, per key, the last
token it accepted and applies a write only if its token is at least that one::

    import redis
    from celery_leases import FencedRedis

    results = FencedRedis(redis.Redis.from_url("redis://localhost:6379/1"), prefix="results")

    with leases.hold("report:42", ttl=30, wait=10) as lease:
        report = build_report(42)
        if not results.set("report:42", report, fence=lease):
            ...  # refused: a newer holder has written; this one's result is stale

    results.get("report:42")           # the accepted value (a plain GET of results.key(...))

``set`` and ``hset`` return True when the write was applied and False when it was refused
(``raise_stale=True`` raises :class:`~celery_leases.StaleFence` instead). An equal token is
accepted, so one holder can write many times; a key with no record accepts any token.
:class:`AsyncFencedRedis` is the same on redis-py's asyncio client. The data store may be any
Redis (one server, Sentinel, Cluster): it need not be the one that holds the leases.

Both keys of a name, the data ``{<prefix>:<name>}`` and its record ``{<prefix>:<name>}:fence``,
are in one hash slot, and every accepted write gives them the same expiry (``ttl``) or none,
so the record never runs out before its data. Write the data only through the fenced store:
a plain ``SET`` or ``EXPIRE`` on the data key bypasses the check.

For SQL stores, see the recipe in the docs (``hold-and-once.md``, "Fenced writes").

.. versionadded:: 0.1
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final, Literal, cast

import redis
import redis.asyncio
from redis.exceptions import DataError, RedisError

from . import _scripts
from ._connect import RedisTarget, aclose_client, make_async_client, make_client, parse_target
from ._keys import fenced_keys
from ._lease import Lease
from .config import safe_url
from .exceptions import LeaseBackendError, LeaseConfigError, StaleFence

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster
    from redis.typing import EncodableT, FieldT

__all__ = ("AsyncFencedRedis", "FencedRedis")

#: the default key prefix of a fenced store
DEFAULT_PREFIX: Final = "fenced"

_Op = Literal["set", "hset"]


def token_of(fence: int | Lease) -> int:
    """The fencing token of ``fence`` (a :class:`~celery_leases.Lease` or its ``token``).

    Raises:
        LeaseConfigError: ``fence`` is neither a Lease nor a whole number >= 0.
    """
    if isinstance(fence, Lease):
        return fence.token
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        msg = f"fence must be a Lease or its token (a whole number >= 0), not {fence!r}"
        raise LeaseConfigError(msg)
    return fence


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        msg = f"a fenced name must be a non-empty str, not {name!r}"
        raise LeaseConfigError(msg)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = f"fenced name {name!r} cannot be encoded as UTF-8: {exc.reason}"
        raise LeaseConfigError(msg) from None


def _ttl_ms(ttl: float | None) -> int:
    if ttl is None:
        return 0
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, (int, float))
        or not 0 < ttl < math.inf  # NaN fails both
    ):
        msg = f"ttl must be a number of seconds > 0 or None, not {ttl!r}"
        raise LeaseConfigError(msg)
    # rounded up: the data lives at least ttl, never a millisecond less (and never 0 = none)
    return max(1, math.ceil(ttl * 1000))


def _hset_args(mapping: Mapping[FieldT, EncodableT]) -> list[EncodableT]:
    if not mapping:
        msg = "a fenced hset needs at least one field"
        raise LeaseConfigError(msg)
    flat: list[EncodableT] = []
    for field, value in mapping.items():
        flat += [field, value]
    return flat


def _outcome(name: str, token: int, reply: object, *, raise_stale: bool) -> bool:
    applied, seen = cast("tuple[int, bytes | str]", reply)  # the script's {code, token}
    if int(applied) == _scripts.FencedWriteReply.APPLIED:
        return True
    if raise_stale:
        raise StaleFence(name, token, int(seen))
    return False


class _Fenced:
    """What the sync and asyncio stores share: key names, arguments, error messages."""

    def __init__(self, prefix: str, where: str) -> None:
        if not isinstance(prefix, str) or not prefix:
            msg = f"a fenced store's prefix must be a non-empty str, not {prefix!r}"
            raise LeaseConfigError(msg)
        self.prefix = prefix
        self._where = where

    def key(self, name: str) -> str:
        """The data key of ``name`` (read it with a plain ``GET``/``HGETALL`` if you like)."""
        _check_name(name)
        return fenced_keys(self.prefix, name)[0]

    def fence_key(self, name: str) -> str:
        """The key of ``name``'s fence record: a STRING, the last accepted token."""
        _check_name(name)
        return fenced_keys(self.prefix, name)[1]

    def _call(
        self, name: str, fence: int | Lease, ttl: float | None, op: _Op, payload: list[EncodableT]
    ) -> tuple[int, list[str], list[EncodableT]]:
        _check_name(name)
        token = token_of(fence)
        keys = list(fenced_keys(self.prefix, name))
        return token, keys, [str(token), _ttl_ms(ttl), op, *payload]

    @contextmanager
    def _backend(self, what: str) -> Iterator[None]:
        try:
            yield
        except DataError as exc:  # redis-py cannot encode a value (None, a dict...): ours
            msg = f"cannot {what}: {exc}"
            raise LeaseConfigError(msg) from exc
        except RedisError as exc:
            msg = f"redis{self._where} failed to {what}: {type(exc).__name__}: {exc}"
            raise LeaseBackendError(msg) from exc


def _where(url: str | None) -> str:
    return f" at {safe_url(url)}" if url else ""


def _target(url: str) -> RedisTarget:
    try:
        return parse_target(url)
    except ValueError as exc:
        raise LeaseConfigError(str(exc)) from None


class FencedRedis(_Fenced):
    """A fenced store on a synchronous redis-py client.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``, or a URL of the forms
            ``redis_url`` takes (``redis://``, ``sentinel://``, ``redis+cluster://``...); a
            client made from a URL is closed by :meth:`close`.
        prefix: every key of this store is in the hash tag ``{<prefix>:<name>}``.

    .. versionadded:: 0.1
    """

    def __init__(
        self, client: redis.Redis | RedisCluster | str, *, prefix: str = DEFAULT_PREFIX
    ) -> None:
        url = client if isinstance(client, str) else None
        super().__init__(prefix, _where(url))
        self._owned = url is not None
        self.client: redis.Redis | RedisCluster
        if isinstance(client, str):
            self.client = make_client(_target(client))
        else:
            self.client = client
        # register_script only hashes locally; each store keeps its own Script object
        self._script = self.client.register_script(_scripts.FENCED_WRITE)

    def set(
        self,
        name: str,
        value: EncodableT,
        *,
        fence: int | Lease,
        ttl: float | None = None,
        raise_stale: bool = False,
    ) -> bool:
        """Set ``name`` to ``value`` unless a newer token was accepted for it.

        Args:
            name: what to write (any non-empty text; it is escaped into the key).
            value: what redis-py can send (str, bytes, int, float).
            fence: the writer's :class:`~celery_leases.Lease` or its token.
            ttl: seconds the value (and its fence record) live; None: no expiry. Each
                accepted write sets the expiry, as ``SET`` does.
            raise_stale: raise :class:`~celery_leases.StaleFence` instead of returning False.

        Returns:
            True if the write was applied; False if it was refused (nothing changed).

        Raises:
            StaleFence: refused, with ``raise_stale=True``.
            LeaseConfigError: an invalid name, fence or ttl.
            LeaseBackendError: Redis failed; the write may or may not have been applied.
        """
        token, keys, args = self._call(name, fence, ttl, "set", [value])
        with self._backend(f"write {name!r}"):
            reply = self._script(keys, args)
        return _outcome(name, token, reply, raise_stale=raise_stale)

    def hset(
        self,
        name: str,
        mapping: Mapping[FieldT, EncodableT],
        *,
        fence: int | Lease,
        ttl: float | None = None,
        raise_stale: bool = False,
    ) -> bool:
        """Set the fields of hash ``name`` unless a newer token was accepted for it.

        Other fields of the hash are kept (``HSET``). Arguments, return value and errors are
        those of :meth:`set`; each accepted write sets the hash's expiry to ``ttl`` (None:
        none), like :meth:`set`.
        """
        token, keys, args = self._call(name, fence, ttl, "hset", [*_hset_args(mapping)])
        with self._backend(f"write {name!r}"):
            reply = self._script(keys, args)
        return _outcome(name, token, reply, raise_stale=raise_stale)

    def get(self, name: str) -> bytes | str | None:
        """The value last written by :meth:`set` (None when there is none)."""
        with self._backend(f"read {name!r}"):
            value: bytes | str | None = self.client.get(self.key(name))
        return value

    def last_fence(self, name: str) -> int | None:
        """The last token accepted for ``name`` (None: no write yet, or it expired)."""
        with self._backend(f"read the fence of {name!r}"):
            raw = self.client.get(self.fence_key(name))
        return None if raw is None else int(raw)

    def close(self) -> None:
        """Close the client if this store made it from a URL (a given client is yours)."""
        if self._owned:
            self.client.close()


class AsyncFencedRedis(_Fenced):
    """:class:`FencedRedis` on redis-py's asyncio client; the methods are coroutines.

    Args:
        client: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``, or a URL
            (closed by :meth:`aclose`).
        prefix: every key of this store is in the hash tag ``{<prefix>:<name>}``.

    The keys, the script and the rules are those of :class:`FencedRedis`, so sync and asyncio
    writers of one name fence each other.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        client: redis.asyncio.Redis | AsyncRedisCluster | str,
        *,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        url = client if isinstance(client, str) else None
        super().__init__(prefix, _where(url))
        self._owned = url is not None
        self.client: redis.asyncio.Redis | AsyncRedisCluster
        if isinstance(client, str):
            self.client = make_async_client(_target(client))
        else:
            self.client = client
        self._script = self.client.register_script(_scripts.FENCED_WRITE)

    async def set(
        self,
        name: str,
        value: EncodableT,
        *,
        fence: int | Lease,
        ttl: float | None = None,
        raise_stale: bool = False,
    ) -> bool:
        """Set ``name`` to ``value`` unless a newer token was accepted (:meth:`FencedRedis.set`)."""
        token, keys, args = self._call(name, fence, ttl, "set", [value])
        with self._backend(f"write {name!r}"):
            reply = await self._script(keys, args)
        return _outcome(name, token, reply, raise_stale=raise_stale)

    async def hset(
        self,
        name: str,
        mapping: Mapping[FieldT, EncodableT],
        *,
        fence: int | Lease,
        ttl: float | None = None,
        raise_stale: bool = False,
    ) -> bool:
        """Set fields of hash ``name`` unless a newer token was accepted (see ``FencedRedis``)."""
        token, keys, args = self._call(name, fence, ttl, "hset", [*_hset_args(mapping)])
        with self._backend(f"write {name!r}"):
            reply = await self._script(keys, args)
        return _outcome(name, token, reply, raise_stale=raise_stale)

    async def get(self, name: str) -> bytes | str | None:
        """The value last written by :meth:`set` (None when there is none)."""
        with self._backend(f"read {name!r}"):
            value: bytes | str | None = await self.client.get(self.key(name))
        return value

    async def last_fence(self, name: str) -> int | None:
        """The last token accepted for ``name`` (None: no write yet, or it expired)."""
        with self._backend(f"read the fence of {name!r}"):
            raw = await self.client.get(self.fence_key(name))
        return None if raw is None else int(raw)

    async def aclose(self) -> None:
        """Close the client if this store made it from a URL (a given client is yours)."""
        if self._owned:
            await aclose_client(self.client)  # type: ignore[arg-type]
