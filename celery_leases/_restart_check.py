"""The restart check: nothing is granted until every holder of a lost grant knows it is lost.

Redis can come back without grants it had confirmed: restarted from an RDB snapshot or from an
AOF that lost its tail, or failed over to a replica that had not received them. Their holders
still count them held until their next renewal finds them gone (within ``settings.ttl``), so
another owner granted the same resource in that window would run beside them.

Each slot group has a lifetime record, ``"<grace until, ms> <run_id>/<master_replid>"``
(:meth:`~celery_leases._keys.Keyspace.lifetime`). ``lua/lifetime_check.lua`` compares it with
the server's identity (``INFO``) and, when another lifetime wrote it, refuses grants in the
group for ``kept_ms``. It runs on every new connection, before the connection carries anything
else: a restart or a failover drops every connection, so in a new server lifetime the check
always comes before the first grant, and the scripts that grant only read the record (one
``GET``) instead of paying for ``INFO`` on every grant. A missing record (a new Redis, or one
that came back empty) is the ``restart_grace`` setting's case: the scripts that grant handle
it themselves (``lua/_lifetime.lua``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from celery.utils.log import get_logger
from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError

from . import _scripts
from ._engine import grace_arg, kept_grace
from ._keys import Keyspace
from .config import LeaseSettings

logger = get_logger(__name__)


class ConnectCheck:
    """The check every new connection runs before anything else (``redis_connect_func``).

    Args:
        records: the lifetime record key of every slot group.
        settings: the store's settings (the two graces).
        per_group: one call per group, for a cluster client (a call for a group on another
            node is answered MOVED and skipped: that node's own connections check it).
        connect_first: run redis-py's connect step first (AUTH, SELECT...): redis-py runs
            ``redis_connect_func`` instead of it, except the sync cluster client, which
            runs it before.
    """

    def __init__(
        self,
        records: Sequence[str],
        settings: LeaseSettings,
        *,
        per_group: bool,
        connect_first: bool,
    ) -> None:
        self._args = [math.ceil(kept_grace(settings) * 1000), grace_arg(settings)]
        self._calls: list[list[str]] = [[k] for k in records] if per_group else [list(records)]
        self._connect_first = connect_first
        self._refused = False

    def _commands(self) -> list[tuple[Any, ...]]:
        return [
            ("EVALSHA", _scripts.SHA["lifetime_check"], len(keys), *keys, *self._args)
            for keys in self._calls
        ]

    def _outcome(self, replies: list[Any]) -> None:
        for reply in replies:
            # MOVED: a group of another node; ASK: one migrating away (its record moves with it)
            if isinstance(reply, (MovedError, AskError)):
                continue
            if isinstance(reply, ResponseError):
                problem = f"the check failed: {reply}"
            elif int(reply[1]) == _scripts.LifetimeCheckReply.INFO_REFUSED:
                problem = "INFO is refused (an ACL without +info)"
            else:
                continue
            if not self._refused:  # once per client: it says the same on every connection
                self._refused = True
                logger.warning(
                    "leases: Redis restarts that keep data (RDB, AOF, failover) cannot be "
                    "recognised, %s; only a Redis found empty is (restart_grace)",
                    problem,
                )

    def __call__(self, conn: Any) -> None:
        """Run the check on ``conn`` (sync), after redis-py's own connect step."""
        if self._connect_first:
            conn.on_connect()
        self._outcome(self._run(conn))

    def _run(self, conn: Any) -> list[Any]:
        replies = self._send(conn, self._commands())
        if any(isinstance(r, NoScriptError) for r in replies):
            self._send(conn, [("SCRIPT", "LOAD", _scripts.LIFETIME_CHECK)])
            replies = self._send(conn, self._commands())
        return replies

    @staticmethod
    def _send(conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies

    async def acall(self, conn: Any) -> None:
        """Run the check on ``conn`` (asyncio), after redis-py's own connect step."""
        if self._connect_first:
            await conn.on_connect()
        replies = await self._asend(conn, self._commands())
        if any(isinstance(r, NoScriptError) for r in replies):
            await self._asend(conn, [("SCRIPT", "LOAD", _scripts.LIFETIME_CHECK)])
            replies = await self._asend(conn, self._commands())
        self._outcome(replies)

    @staticmethod
    async def _asend(conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        await conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies


def _check(keys: Keyspace, settings: LeaseSettings, *, cluster: bool, asyncio: bool) -> Any:
    if not kept_grace(settings):
        return None  # only a missing record is looked at, by the scripts that grant
    records = [keys.lifetime(group) for group in range(settings.slot_groups)]
    # the asyncio cluster client has no connect step of its own to run before the hook
    connect_first = asyncio or not cluster
    return ConnectCheck(records, settings, per_group=cluster, connect_first=connect_first)


def connect_hook(
    keys: Keyspace, settings: LeaseSettings, *, cluster: bool
) -> Callable[[Any], None] | None:
    """The sync client's ``redis_connect_func``: the check on every group's record, or None
    when restarts that keep data are not checked (``kept_grace`` is 0)."""
    check: ConnectCheck | None = _check(keys, settings, cluster=cluster, asyncio=False)
    return check


def aconnect_hook(
    keys: Keyspace, settings: LeaseSettings, *, cluster: bool
) -> Callable[[Any], Awaitable[None]] | None:
    """The asyncio client's ``redis_connect_func``, as :func:`connect_hook`."""
    check: ConnectCheck | None = _check(keys, settings, cluster=cluster, asyncio=True)
    return None if check is None else check.acall
