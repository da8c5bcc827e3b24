"""``celery leases``: see who holds what, and free what a dead holder left behind.

The commands run against the ``-A`` app's settings (its ``Leases(app)``, or one made from
``app.conf.leases_*``, ``CELERY_LEASES_*`` and the defaults)::

    celery -A proj leases ls [--owner NODE] [--resource PATTERN] [--json]
    celery -A proj leases show RESOURCE [--json]
    celery -A proj leases history [--resource R] [--node N] [-n K] [--json]
    celery -A proj leases top [--interval S] [-n ROWS] [--once]
    celery -A proj leases health [--node NODE]
    celery -A proj leases release RESOURCE [--force] [--yes]
    celery -A proj leases owners [--json]
    celery -A proj leases reconcile [--json]
    celery -A proj leases stats [--json]
    celery -A proj leases audit [-n N] [--json]

- ``ls``: every held lease, found through the owners index and each owner's registry (never a
  keyspace scan): resource, mode (``exclusive``/``shared``), fencing token, owner, node, the
  holding task's id, seconds left on the lease, and whether its owner is alive. Registry
  entries whose lease already ran out (or was released or taken over) are left out: they hold
  nothing, and the next reconcile or cleanup removes them; ``stats`` counts them. ``--owner``
  takes a node name (a worker hostname such as ``celery@pod-7``) or one full owner id;
  ``--resource`` an ``fnmatch`` pattern, case-sensitive (``'repo:*'``). ``--json`` prints a
  list of objects with ``resource``, ``mode``, ``token``, ``owner``, ``node``, ``task_id``,
  ``task_name``, ``expires_in``, ``alive``, ``liveness``, ``status`` and ``renewed_ago``. The
  task name is asked of the live workers (remote control, at most 1 s): the registry records
  the id only. The LIVENESS column says ``alive`` only while the owner renews on time,
  ``renewed N s ago`` once it missed renewals (killed, stalled or idle) until its liveness runs
  out, then ``dead``. Names are escaped and shortened in the table, whole in ``--json``.
  Claims of tasks declared ``unique=`` show as resources ``celery_leases:unique:<key>``: a
  running one as the exclusive lease of the worker process that runs it, a queued one (its
  task not started yet; read from each slot group's index of queued claims) with mode
  ``queued``, no owner or node (null), and its task's id.
  ``--owner`` leaves queued claims out (no process holds them).
- ``show RESOURCE``: the holders of one resource, read from its own keys, with each owner's
  liveness and the task id from that owner's registry entry, then its record: since when it
  is held (from the token), its last renewal, its changes of hands, its waiters and its last
  events (the last three need the ``history`` setting). ``--json`` prints the record as one
  object (``holders``, ``granted_at``, ``renewed_at``, ``transitions``, ``waiters``,
  ``history``).
- ``history``: the last events (``granted``, ``busy``, ``released``, ``expired``, ``freed``,
  ``forced``, ``lost``), fleet-wide or of one ``--resource`` or ``--node``; needs the
  ``history`` setting.
- ``top``: a live view of held leases, their waiters and busy attempts per second;
  ``--once`` prints one frame.
- ``health``: exit 0 when Redis answers and, with ``--node``, that node is alive (its worker
  marks itself so at every reaper pass, or one of its processes renews on time); 1 when Redis
  does not answer, 2 when the node is stale. For Kubernetes probes.
- ``release RESOURCE``: frees the resource's leases whose owner is dead (its liveness ran out,
  or it is no longer registered). If any holder is alive it changes nothing and exits 1, naming
  the live owner, unless ``--force``; ``--force`` asks before freeing a live owner's lease
  unless ``--yes``. A live holder learns of it at its next renewal (``LeaseLost``, interrupting
  a task body by default). Every release is logged (a forced one at WARNING, through celery's
  logger) and appended to the audit list in Redis, ``forced`` telling whether the owner was
  alive.
- ``owners``: every registered owner by node, its liveness (as in ``ls``; ``--json`` adds
  ``status`` and ``renewed_ago`` to the seconds left, negative once it ran out) and the number
  of leases it holds. An owner whose liveness ran out is dead, or alive
  but idle: a process holding nothing does not renew its liveness; a reconcile forgets it.
  One that holds nothing on a node whose worker marked itself alive (with the owner's
  incarnation, as ``health --node`` reads it) shows ``idle``, not late or dead.
- ``reconcile``: one orphan-reconcile pass now (what workers do every ``reconcile_interval``):
  frees the leases of owners whose liveness ran out, and reports them.
- ``stats``: owners alive and dead, leases held (exclusive, shared), stale registry entries,
  per node.
- ``audit``: the last ``N`` releases made with ``release`` (default 20; the list keeps 1000).

``--force`` and ``--yes`` are never read from the environment (celery's CLI would otherwise
take ``CELERY_LEASES_RELEASE_FORCE``), nor is any other option of these commands.

Exit status: 0 done; 1 refused, nothing held, aborted, or a reconcile that could not clean
every owner (``health``: Redis does not answer); 2 bad usage (``health``: the node is
stale); 69 Redis could not be reached or failed; 75 another process is reconciling (try
again); 78 invalid settings. Errors are one line on stderr, URLs without their password.

.. versionadded:: 0.1
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import click
from celery import signals as _signals
from celery._state import get_current_app
from celery.bin.base import CeleryCommand, CLIContext
from celery.utils.log import get_logger
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ._identity import default_node, set_node
from ._inspect import AUDIT_KEEP, Holder
from ._keys import node_of_owner, split_owner, unescape
from ._registry import QUEUED_OWNER, Entry
from ._render import printable, table
from ._sync.driver import LeaseStore
from .app import Leases, find_leases
from .config import safe_url, timing
from .exceptions import LeaseBackendError, LeaseConfigError, LeaseError
from .task import unleased_tasks
from .worker import RECONCILE_RESOURCE, run_reconcile

if TYPE_CHECKING:
    from celery import Celery

    from .config import LeaseSettings

__all__ = ("leases",)

logger = get_logger(__name__)

#: exit statuses (sysexits.h) beyond click's 1 (failure) and 2 (usage)
EX_UNAVAILABLE: Final = 69
EX_TEMPFAIL: Final = 75
EX_CONFIG: Final = 78

_MODES: Final = {"x": "exclusive", "s": "shared"}
#: how long ls and show wait for the workers to name their tasks, in seconds
_NAMES_TIMEOUT: Final = 1.0

F = TypeVar("F", bound=Callable[..., Any])


# --- plumbing -------------------------------------------------------------------------------
class _Failure(click.ClickException):
    """One line on stderr (``Error: ...``) and a non-zero exit, never a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class _ConfigFailure(_Failure):
    exit_code = EX_CONFIG


class _BackendFailure(_Failure):
    exit_code = EX_UNAVAILABLE


class _TryAgain(_Failure):
    exit_code = EX_TEMPFAIL


class _Command(CeleryCommand):
    """A ``celery leases`` sub-command: library errors become one line and an exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LeaseConfigError as exc:
            raise _ConfigFailure(str(exc)) from None
        except LeaseBackendError as exc:
            raise _BackendFailure(str(exc)) from None
        except LeaseError as exc:
            raise _Failure(str(exc)) from None


def _json_option(f: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, allow_from_autoenv=False, help="Print JSON."
    )(f)


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_object(CLIContext)
    return obj.app if obj is not None else get_current_app()


def _ext(ctx: click.Context) -> Leases:
    """The app's ``Leases`` (made by the app module), or one made now from its settings."""
    app = _app(ctx)
    return find_leases(app) or Leases(app)


def _echo_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2))


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An aligned table; names escaped, long ones shortened (``--json`` keeps them whole)."""
    return table(headers, rows, limits=_LIMITS)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


class Renewals(NamedTuple):
    """How owners renew their liveness: the ``ttl`` setting, and the heartbeat's interval."""

    ttl: float
    every: float  # the longest a holder's heartbeat waits between renewals

    @classmethod
    def of(cls, settings: LeaseSettings) -> Renewals:
        """The renewals that workers with ``settings`` make."""
        # the heartbeat renews at the renewal interval of the shortest lease horizon, a
        # horizon being at most ttl * margin_fraction (see LeaseStore.horizon)
        return cls(settings.ttl, timing(settings).every)


def renewed_ago(liveness: float | None, renewals: Renewals) -> float | None:
    """Seconds since an owner last refreshed its liveness, or None if that cannot be told.

    Every grant and renewal sets the owner's liveness score to its Redis time plus the
    ``ttl`` setting (acquire.lua, renew.lua), so the last refresh was ``ttl - liveness``
    seconds ago. A liveness longer than this process's ``ttl`` comes from an owner with a
    longer ``ttl`` setting: when it renewed is then unknown.
    """
    if liveness is None or liveness > renewals.ttl:
        return None
    return max(renewals.ttl - liveness, 0.0)


def liveness_state(liveness: float | None, renewals: Renewals) -> str:
    """``alive``, ``late``, ``expired`` or ``unregistered``: what an owner's liveness says.

    Alive only while its renewals come as often as a holder's heartbeat sends them, with a
    little slack: an owner killed a moment ago is ``late`` (its liveness has not run out yet,
    so a reconcile leaves it alone) until it ``expired``. An idle owner (it holds nothing, so
    nothing renews it) is late and then expired too.
    """
    if liveness is None:
        return "unregistered"
    if liveness <= 0:
        return "expired"
    ago = renewed_ago(liveness, renewals)
    # the slack covers a renewal that took a moment to reach Redis, not a missed one
    if ago is not None and ago > renewals.every + min(1.0, renewals.every / 3):
        return "late"
    return "alive"


def _liveness_text(liveness: float | None, renewals: Renewals, *, idle: bool = False) -> str:
    if idle:
        return "idle (holds nothing; its node is alive)"
    state = liveness_state(liveness, renewals)
    if liveness is None:
        return "dead (not registered)"
    if state == "expired":
        return f"dead (expired {_seconds(-liveness)} ago)"
    ago = renewed_ago(liveness, renewals)
    if ago is None:
        return f"alive ({_seconds(liveness)} left)"
    if state == "late":
        return f"renewed {_seconds(ago)} ago, expires in {_seconds(liveness)}"
    return f"alive (renewed {_seconds(ago)} ago)"


def _non_empty(what: str, value: str | None) -> None:
    if value is not None and not value.strip():
        raise click.UsageError(f"{what} must not be empty")


def _operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in the environment or the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class _Row:
    """One held lease, as the commands show it."""

    resource: str
    mode: str  # "x" or "s"
    token: int
    owner: str
    task_id: str | None
    expires_in: float
    liveness: float | None  # seconds left on the owner's liveness; None: not registered
    task_name: str | None = None  # as the owner's live worker tells it (see _named)

    @property
    def queued(self) -> bool:
        """A unique task's claim, queued: its task is not started, no process holds it."""
        return self.owner.startswith(QUEUED_OWNER)

    @property
    def node(self) -> str:
        return "-" if self.queued else node_of_owner(self.owner)

    @property
    def alive(self) -> bool:
        return self.liveness is not None and self.liveness > 0

    @property
    def holder(self) -> Holder:
        return Holder(self.resource, self.mode, self.token, self.owner, self.expires_in)

    def as_json(self, renewals: Renewals) -> dict[str, object]:
        ago = None if self.queued else renewed_ago(self.liveness, renewals)
        return {
            "resource": self.resource,
            "mode": "queued" if self.queued else _MODES[self.mode],
            "token": self.token,
            "owner": None if self.queued else self.owner,
            "node": None if self.queued else self.node,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "expires_in": _round(self.expires_in),
            "alive": self.alive,
            "liveness": _round(self.liveness),
            "status": "queued" if self.queued else liveness_state(self.liveness, renewals),
            "renewed_ago": _round(ago),
        }

    def cells(self, renewals: Renewals) -> list[object]:
        return [
            self.resource,
            "queued" if self.queued else _MODES[self.mode],
            self.token,
            f"{self.expires_in:.1f}s",
            self.node,
            "-" if self.queued else self.owner,
            "queued (not started)" if self.queued else _liveness_text(self.liveness, renewals),
            self.task_id or "-",
            self.task_name or "-",
        ]


#: the widest a column of user data is shown, in terminal columns (``--json``: whole)
_LIMITS: Final = {
    "RESOURCE": 60,
    "NODE": 40,
    "OWNER": 64,
    "TASK_ID": 40,
    "TASK": 48,
    "BY": 40,
}

_ROW_HEADERS: Final = (
    "RESOURCE",
    "MODE",
    "TOKEN",
    "EXPIRES_IN",
    "NODE",
    "OWNER",
    "LIVENESS",
    "TASK_ID",
    "TASK",
)


@dataclass
class _Census:
    """Every registered owner, its liveness, and what its registry lists (held or stale)."""

    liveness: dict[str, float | None]
    held: list[_Row]
    stale: dict[str, int]  # owner -> registry entries whose lease is gone
    queued: list[_Row]  # claims of unique tasks not started yet (held by no process)


def _census(store: LeaseStore, *, owner: str | None = None, pattern: str | None = None) -> _Census:
    """Walk the owners index and the owners' registries (never the keyspace)."""
    liveness: dict[str, float | None] = dict(store.owners())
    owners = sorted(liveness)
    if owner is not None:
        owners = [o for o in owners if owner in (o, node_of_owner(o))]
        # an owner listed under its node but gone from the index still shows (as dead)
        for o in store.node_owners(owner):
            if o not in liveness:
                liveness[o] = None
                owners.append(o)
    registries = store.read_registries(owners)
    items: list[tuple[str, Entry]] = [
        (o, e)
        for o in owners
        for e in registries[o]
        if pattern is None or fnmatchcase(e.resource, pattern)
    ]
    held: list[_Row] = []
    stale: dict[str, int] = {}
    for (o, e), found in zip(items, store.check_entries(items), strict=True):
        if found is None:
            stale[o] = stale.get(o, 0) + 1
        else:
            expires_in, token = found
            held.append(_Row(e.resource, e.mode, token, o, e.task_id, expires_in, liveness[o]))
    held.sort(key=lambda r: (r.resource, r.token, r.owner))
    queued: list[_Row] = []
    if owner is None:
        for claim in store.queued_claims():
            resource = store.keys.unique_resource(claim.key)
            if pattern is not None and not fnmatchcase(resource, pattern):
                continue
            pseudo_owner = f"{QUEUED_OWNER}{claim.task_id}"
            expires_in = claim.expires_in or 0.0  # queued claims always have a TTL
            queued.append(
                _Row(resource, "x", claim.token, pseudo_owner, claim.task_id, expires_in, None)
            )
    return _Census({o: liveness[o] for o in owners}, held, stale, queued)


def _holder_rows(store: LeaseStore, resource: str) -> list[_Row]:
    """The holders of ``resource``, with their owners' liveness and task ids."""
    holders = store.holders(resource)
    if not holders:
        raise _Failure(f"no lease is held on {resource!r}")
    owners = sorted({h.owner for h in holders})
    liveness = store.read_liveness(owners)
    registries = store.read_registries(owners)
    rows = []
    for h in holders:
        task_id = next(
            (
                e.task_id
                for e in registries[h.owner]
                if (e.resource, e.mode, e.token) == (resource, h.mode, h.token)
            ),
            None,
        )
        if h.owner.startswith(QUEUED_OWNER):  # a unique task's queued claim
            task_id = unescape(h.owner.removeprefix(QUEUED_OWNER))
        rows.append(
            _Row(resource, h.mode, h.token, h.owner, task_id, h.expires_in, liveness[h.owner])
        )
    return rows


def _ls_rows(
    app: Celery, store: LeaseStore, *, owner: str | None = None, pattern: str | None = None
) -> list[_Row]:
    """The rows of ``ls``: held leases and queued unique claims, by resource, named."""
    census = _census(store, owner=owner, pattern=pattern)
    rows = sorted(census.held + census.queued, key=lambda r: (r.resource, r.token, r.owner))
    return _named(app, rows)


def ls_json(
    app: Celery, store: LeaseStore, *, owner: str | None = None, pattern: str | None = None
) -> list[dict[str, object]]:
    """What ``ls --json`` prints (the web view's ``GET /api/leases`` serves the same)."""
    renewals = Renewals.of(store.settings)
    return [row.as_json(renewals) for row in _ls_rows(app, store, owner=owner, pattern=pattern)]


def _named(app: Celery, rows: list[_Row]) -> list[_Row]:
    """``rows`` with the names of their tasks, as the workers still running them tell.

    The registry records a task's id only (its entry format is read by every worker of a
    rolling deploy, and a name written at each grant would cost the hot path), so the names
    come from the live workers themselves: one remote-control ``query_task`` to the nodes of
    live owners, waited for at most ``_NAMES_TIMEOUT`` (an unreachable broker or a busy
    worker costs that, never an error). A dead worker names nothing.
    """
    ids: dict[str, set[str]] = {}  # node -> ids of the tasks holding its leases
    for row in rows:
        if row.task_id is not None and not row.queued and row.alive:
            ids.setdefault(row.node, set()).add(row.task_id)
    if not ids:
        return rows
    replies: dict[str, Any] = {}

    def ask() -> None:
        try:
            inspect = app.control.inspect(
                destination=sorted(ids), timeout=_NAMES_TIMEOUT, limit=len(ids)
            )
            replies.update(inspect.query_task(*sorted(set().union(*ids.values()))) or {})
        except Exception as exc:  # the broker is optional to this command
            logger.debug("leases: could not ask the workers for task names: %s", exc)

    # in a thread: a broker that does not answer must not hold the listing up
    asker = threading.Thread(target=ask, name="celery-leases-names", daemon=True)
    asker.start()
    asker.join(_NAMES_TIMEOUT + 0.5)
    names: dict[tuple[str, str], str] = {}
    for node, tasks in dict(replies).items():
        # {task id: [state, info]}; anything else (an error reply) names nothing
        for task_id, reply in tasks.items() if isinstance(tasks, dict) else ():
            info = reply[1] if isinstance(reply, (list, tuple)) and len(reply) == 2 else None
            name = info.get("name") if isinstance(info, dict) else None
            if isinstance(name, str):
                names[(node, task_id)] = name
    return [
        replace(row, task_name=names.get((row.node, row.task_id or ""), row.task_name))
        for row in rows
    ]


# --- the commands ---------------------------------------------------------------------------
@click.group(name="leases")
def leases() -> None:
    """Inspect leases and free those of dead holders (celery_leases)."""
    if not logging.root.handlers:
        # celery's loggers end in a NullHandler outside a worker: without this, the WARNING
        # of a forced release (and a reconcile's errors) would reach no one
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")


@leases.command("ls", cls=_Command)
@click.option(
    "--owner",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Only leases of owners on this node (a worker hostname), or of this owner id.",
)
@click.option(
    "--resource",
    "pattern",
    metavar="PATTERN",
    allow_from_autoenv=False,
    help="Only resources matching this fnmatch pattern (case-sensitive), e.g. 'repo:*'.",
)
@_json_option
@click.pass_context
def ls(ctx: click.Context, owner: str | None, pattern: str | None, as_json: bool) -> None:
    """List every held lease.

    Found through the owners index and the owners' registries; leases that already ran out
    are left out.
    """
    _non_empty("--owner", owner)
    _non_empty("--resource", pattern)
    store = _ext(ctx).store
    renewals = Renewals.of(store.settings)
    rows = _ls_rows(_app(ctx), store, owner=owner, pattern=pattern)
    if as_json:
        _echo_json([row.as_json(renewals) for row in rows])
    elif not rows:
        click.echo("no leases held")
    else:
        click.echo(_table(_ROW_HEADERS, (row.cells(renewals) for row in rows)))


@leases.command("show", cls=_Command)
@click.argument("resource")
@_json_option
@click.pass_context
def show(ctx: click.Context, resource: str, as_json: bool) -> None:
    """Show who holds RESOURCE, since when, who waits for it and what happened to it.

    Each holder with its owner's liveness and the id of the task that holds it; the grant
    and last renewal times, the changes of hands and the last events need the history
    setting.
    """
    _non_empty("RESOURCE", resource)
    store = _ext(ctx).store
    renewals = Renewals.of(store.settings)
    record = store.lease_record(resource)
    if not record["holders"] and not record["history"] and not record["waiters"]:
        raise _Failure(f"no lease is held on {resource!r}")
    rows = _named(_app(ctx), _holder_rows(store, resource)) if record["holders"] else []
    by_grant = {(row.owner, row.token): row for row in rows}
    for holder in record["holders"]:
        row = by_grant.get((holder["owner"] or "", holder["token"]))
        if row is None and holder["owner"] is None:  # a queued claim
            row = next((r for r in rows if r.queued and r.token == holder["token"]), None)
        if row is not None:
            shown = row.as_json(renewals)
            holder.update(
                {k: shown[k] for k in ("task_name", "alive", "liveness", "status", "expires_in")}
            )
            holder["owner_renewed_ago"] = shown["renewed_ago"]
            holder["task_id"] = holder["task_id"] or row.task_id
    if as_json:
        _echo_json(record)
        return
    if rows:
        click.echo(_table(_ROW_HEADERS, (row.cells(renewals) for row in rows)))
    else:
        click.echo(f"{printable(resource)}: not held")
    now = record["now"]
    click.echo("")
    click.echo(f"granted:      {_when(record['granted_at'], now, 'at or before ')}")
    click.echo(f"renewed:      {_when(record['renewed_at'], now)}")
    transitions = record["transitions"]
    click.echo(f"transitions:  {'unknown (history off)' if transitions is None else transitions}")
    click.echo(f"waiters:      {record['waiters']}")
    if record["history"]:
        click.echo("")
        click.echo(_events_table(record["history"][:10], now))


def _when(at: float | None, now: float, prefix: str = "") -> str:
    """An epoch time as UTC and its age, or ``-``."""
    if at is None:
        return "-"
    stamp = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds")
    return f"{prefix}{stamp} ({_seconds(max(now - at, 0.0))} ago)"


_EVENT_HEADERS: Final = ("AT", "AGO", "EVENT", "RESOURCE", "NODE", "TOKEN", "TASK_ID", "BY")


def _events_table(events: Sequence[dict[str, Any]], now: float) -> str:
    rows = (
        [
            datetime.fromtimestamp(e["at"], timezone.utc).strftime("%H:%M:%S.%f")[:-3],
            _seconds(max(now - e["at"], 0.0)),
            e["event"],
            e["resource"] or "-",
            e["node"] or "-",
            e["token"] or "-",
            e["task_id"] or "-",
            e.get("by") or "-",
        ]
        for e in events
    )
    return _table(_EVENT_HEADERS, rows)


@leases.command("history", cls=_Command)
@click.option(
    "--resource",
    metavar="RESOURCE",
    allow_from_autoenv=False,
    help="Only this resource's events (its own stream).",
)
@click.option(
    "--node",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Only events of owners on this node (a worker hostname).",
)
@click.option(
    "-n",
    "count",
    type=click.IntRange(1, 100_000),
    default=20,
    show_default=True,
    allow_from_autoenv=False,
    help="How many of the newest events to show.",
)
@_json_option
@click.pass_context
def history(
    ctx: click.Context, resource: str | None, node: str | None, count: int, as_json: bool
) -> None:
    """Show the last events: granted, released, expired, freed, lost, forced, busy.

    Newest first, fleet-wide (every slot group's stream) or of one resource. Written only
    with the history setting (0, the default, writes nothing).
    """
    _non_empty("--resource", resource)
    _non_empty("--node", node)
    store = _ext(ctx).store
    events = store.history(resource=resource, node=node, count=count)
    if as_json:
        _echo_json(events)
    elif events:
        click.echo(_events_table(events, store.redis_time()))
    elif not store.settings.history:
        click.echo("no history: the history setting is 0 (off); see docs/operations.md")
    else:
        click.echo("no events recorded")


#: exit statuses of ``health`` (Kubernetes probes read only zero or not)
HEALTH_NO_REDIS: Final = 1
HEALTH_NODE_STALE: Final = 2


@leases.command("health", cls=_Command)
@click.option(
    "--node",
    metavar="NODE",
    allow_from_autoenv=False,
    help="Also require this node's liveness to be fresh (a worker hostname).",
)
@click.pass_context
def health(ctx: click.Context, node: str | None) -> None:
    """Exit 0 when Redis answers (and, with --node, NODE's liveness is fresh).

    For Kubernetes probes; needs no worker. Exit 1: Redis does not answer (the URL is shown
    without its password). Exit 2: NODE's worker has not marked itself alive within the ttl
    (its main process does every ttl / 3) and none of its processes renews a liveness on
    time (when one last did, or that none is registered).
    """
    _non_empty("--node", node)
    store = _ext(ctx).store
    try:
        store.ping()
    except LeaseBackendError as exc:
        click.echo(f"unhealthy: {exc}", err=True)
        ctx.exit(HEALTH_NO_REDIS)
    url = safe_url(store.settings.url)
    if node is None:
        click.echo(f"ok: redis at {url} answers")
        return
    renewals = Renewals.of(store.settings)
    marked = store.node_alive(node)
    if marked is not None:
        ago = renewed_ago(marked, renewals)
        when = "" if ago is None else f", marked {_seconds(ago)} ago"
        click.echo(f"ok: redis at {url} answers; node {node} is alive (its worker{when})")
        return
    owners = store.node_owners(node)
    liveness = store.read_liveness(owners)
    known = [left for left in liveness.values() if left is not None]
    fresh = [left for left in known if liveness_state(left, renewals) == "alive"]
    if fresh:
        ago = renewed_ago(max(fresh), renewals)
        when = "" if ago is None else f", renewed {_seconds(ago)} ago"
        click.echo(
            f"ok: redis at {url} answers; node {node} is alive ({len(fresh)} of "
            f"{len(owners)} owner(s) renewing{when})"
        )
        return
    latest = max(known, default=None)
    if latest is not None and latest > 0:
        ago = renewed_ago(latest, renewals)
        last = "" if ago is None else f"renewed {_seconds(ago)} ago, "
        why = (
            f"{last}renewals are due every {_seconds(renewals.every)}; its liveness runs "
            f"out in {_seconds(latest)} (a killed, stalled or idle node)"
        )
    elif latest is not None:
        why = f"its liveness ran out {_seconds(-latest)} ago"
    else:
        why = "it has no registered owner (never started, idle since its last cleanup, or gone)"
    click.echo(f"unhealthy: node {node} is stale: {why}", err=True)
    ctx.exit(HEALTH_NODE_STALE)


@leases.command("top", cls=_Command)
@click.option(
    "--interval",
    type=click.FloatRange(0.2, 3600),
    default=2.0,
    show_default=True,
    allow_from_autoenv=False,
    help="Seconds between frames.",
)
@click.option(
    "-n",
    "limit",
    type=click.IntRange(1, 10_000),
    default=30,
    show_default=True,
    allow_from_autoenv=False,
    help="Rows shown (the leases with the most waiters first).",
)
@click.option(
    "--once",
    is_flag=True,
    allow_from_autoenv=False,
    help="Print one frame and exit (no live view; for scripts and tests).",
)
@click.pass_context
def top(ctx: click.Context, interval: float, limit: int, once: bool) -> None:
    """A live view of held leases, their waiters and busy attempts per second.

    Drawn with rich (a dependency already: every table of these commands uses it).
    busy/s counts the busy events of the history over the last 10 s (history setting).
    """
    store = _ext(ctx).store
    window = max(interval, 10.0)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a pipe or a file: lines as wide as a wide terminal
    if once:
        console.print(_top_frame(store, limit, window))
        return
    with Live(_top_frame(store, limit, window), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(_top_frame(store, limit, window), refresh=True)
        except KeyboardInterrupt:
            pass


def _top_frame(store: LeaseStore, limit: int, window: float) -> Table:
    """One frame of ``top``: a rich Table of the held leases with the most waiters."""
    renewals = Renewals.of(store.settings)
    census = _census(store)
    rows = census.held + census.queued
    waiters = store.waiter_counts([r.resource for r in rows]) if rows else []
    events, _ = store.recent_events(window) if store.settings.history else ([], 0.0)
    busy = sum(1 for e in events if e["event"] == "busy")
    alive = sum(1 for v in census.liveness.values() if v is not None and v > 0)
    rate = f"{busy / window:.1f}" if store.settings.history else "n/a (history off)"
    title = (
        f"{len(rows)} lease(s) held, {sum(waiters)} waiting, owners {alive} alive / "
        f"{len(census.liveness) - alive} dead, busy/s {rate} (last {window:.0f} s)"
    )
    table_ = Table(title=title, title_justify="left")
    for header in ("RESOURCE", "MODE", "NODE", "TASK_ID", "EXPIRES_IN", "LIVENESS", "WAITERS"):
        table_.add_column(header, no_wrap=header != "RESOURCE", min_width=len(header))
    ranked = sorted(zip(rows, waiters, strict=True), key=lambda rw: (-rw[1], rw[0].resource))
    for row, waiting in ranked[:limit]:
        cells = [
            printable(row.resource),
            "queued" if row.queued else _MODES[row.mode],
            printable(row.node),
            printable(row.task_id or "-"),
            f"{row.expires_in:.1f}s",
            "queued" if row.queued else _liveness_text(row.liveness, renewals),
            str(waiting),
        ]
        table_.add_row(*(Text(cell) for cell in cells))  # Text: no markup in user data
    if len(ranked) > limit:
        table_.caption = f"{len(ranked) - limit} more not shown (-n)"
    return table_


def _release_rows(
    store: LeaseStore, resource: str, rows: Sequence[_Row], *, by: str
) -> list[tuple[_Row, bool]]:
    """Free each of ``rows`` (holders of ``resource``), log and audit it: ``(row, freed)``.

    The one forced release: ``release`` calls it once the operator agreed, and so does the
    web view's ``POST /api/leases/release``.
    """
    out: list[tuple[_Row, bool]] = []
    for row in rows:
        freed = store.force_release(
            resource, row.holder, event="forced" if row.alive else "freed", by=by
        )
        if row.alive:
            logger.warning(
                "leases: forced release of %s held by live owner %s (task %s), by %s",
                resource,
                row.owner,
                row.task_id,
                by,
            )
        else:
            logger.info("leases: released %s of dead owner %s, by %s", resource, row.owner, by)
        store.audit(
            {
                "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "by": by,
                "resource": resource,
                "mode": _MODES[row.mode],
                "owner": row.owner,
                "token": row.token,
                "task_id": row.task_id,
                "forced": row.alive,
                "released": freed,
            }
        )
        out.append((row, freed))
    return out


def force_release_json(store: LeaseStore, resource: str, *, by: str) -> list[dict[str, object]]:
    """Free every lease on ``resource``, live holders too, as ``release --force --yes`` does.

    Returns one object per holder (its ``ls --json`` fields, ``released`` telling whether it
    was still held); an empty list when nothing held ``resource``.
    """
    try:
        rows = _holder_rows(store, resource)
    except _Failure:  # nothing holds it
        return []
    renewals = Renewals.of(store.settings)
    return [
        {**row.as_json(renewals), "released": freed}
        for row, freed in _release_rows(store, resource, rows, by=by)
    ]


@leases.command("release", cls=_Command)
@click.argument("resource")
@click.option(
    "--force",
    is_flag=True,
    allow_from_autoenv=False,
    help="Also free a lease whose owner is alive (it learns of it at its next renewal).",
)
@click.option(
    "--yes",
    "-y",
    is_flag=True,
    allow_from_autoenv=False,
    help="With --force: do not ask for confirmation.",
)
@click.pass_context
def release(ctx: click.Context, resource: str, force: bool, yes: bool) -> None:
    """Free the leases on RESOURCE of dead owners.

    A lease whose owner is alive is refused (exit 1) unless --force; --force asks before
    freeing it unless --yes. Every release is recorded in the audit list.
    """
    _non_empty("RESOURCE", resource)
    store = _ext(ctx).store
    rows = _holder_rows(store, resource)
    live = [row for row in rows if row.alive]
    if live:
        who = "; ".join(
            f"{row.owner} (liveness {row.liveness or 0:.1f}s left, task {row.task_id or '-'})"
            for row in live
        )
        if not force:
            msg = (
                f"refusing to release {resource!r}: held by live owner {who}; "
                "use --force to release it anyway"
            )
            raise _Failure(msg)
        if not yes:
            click.confirm(
                f"{resource!r} is held by live owner {who}. It loses the lease at its next "
                "renewal. Release it anyway?",
                abort=True,
            )
    for row, freed in _release_rows(store, resource, rows, by=_operator()):
        state = "live" if row.alive else "dead"
        shown, task = printable(resource), printable(row.task_id or "-")
        if freed and row.queued:
            click.echo(f"released {shown} (queued claim of task {task})")
        elif freed:
            click.echo(f"released {shown} ({_MODES[row.mode]}) of {state} owner {row.owner}")
        else:
            click.echo(f"{shown} of {row.owner} was no longer held (released meanwhile)")


@leases.command("owners", cls=_Command)
@_json_option
@click.pass_context
def owners(ctx: click.Context, as_json: bool) -> None:
    """List the owners by node.

    With the seconds left on each one's liveness (negative: it ran out) and the number of
    leases it holds; an owner that holds nothing on a node whose worker is alive is idle.
    """
    store = _ext(ctx).store
    renewals = Renewals.of(store.settings)
    census = _census(store)
    counts = _counts(census)
    idle = _idle_owners(store, census, renewals)
    listed = sorted(census.liveness, key=lambda o: (node_of_owner(o), o))
    if as_json:
        _echo_json(_owners_json(census, renewals, idle))
    elif not listed:
        click.echo("no owners registered")
    else:
        rows = (
            [
                node_of_owner(owner),
                owner,
                _liveness_text(census.liveness[owner], renewals, idle=owner in idle),
                counts.get(owner, 0),
            ]
            for owner in listed
        )
        click.echo(_table(("NODE", "OWNER", "LIVENESS", "LEASES"), rows))


def _counts(census: _Census) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in census.held:
        counts[row.owner] = counts.get(row.owner, 0) + 1
    return counts


def _idle_owners(store: LeaseStore, census: _Census, renewals: Renewals) -> set[str]:
    """The owners that are idle: late or expired, holding nothing, their node alive.

    A process renews its liveness only while it holds a lease, so a healthy worker's idle
    pool processes run out of it. Their worker's main process marks the node alive at every
    reaper pass (what ``health --node`` reads), with its incarnation: an owner of that
    incarnation that holds nothing is idle, not dead. One of an older incarnation (a worker
    restarted since) is dead all the same.
    """
    counts = _counts(census)
    candidates = [
        owner
        for owner, liveness in census.liveness.items()
        if liveness is not None
        and not counts.get(owner)
        and liveness_state(liveness, renewals) in ("late", "expired")
    ]
    if not candidates:
        return set()
    marks = store.node_marks(sorted({node_of_owner(o) for o in candidates}))
    return {o for o in candidates if marks.get(node_of_owner(o)) == split_owner(o).incarnation}


def _owners_json(
    census: _Census, renewals: Renewals, idle: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, object]]:
    counts = _counts(census)
    out: list[dict[str, object]] = []
    for owner in sorted(census.liveness, key=lambda o: (node_of_owner(o), o)):
        _, incarnation, pid = split_owner(owner)
        liveness = census.liveness[owner]
        out.append(
            {
                "node": node_of_owner(owner),
                "owner": owner,
                "incarnation": incarnation,
                "pid": int(pid) if pid.isdigit() else pid,
                "liveness": _round(liveness),
                "alive": liveness is not None and liveness > 0,
                "status": "idle" if owner in idle else liveness_state(liveness, renewals),
                "renewed_ago": _round(renewed_ago(liveness, renewals)),
                "leases": counts.get(owner, 0),
            }
        )
    return out


def owners_json(store: LeaseStore) -> list[dict[str, object]]:
    """What ``owners --json`` prints (the web view's ``GET /api/owners`` serves the same)."""
    census, renewals = _census(store), Renewals.of(store.settings)
    return _owners_json(census, renewals, _idle_owners(store, census, renewals))


@leases.command("reconcile", cls=_Command)
@_json_option
@click.pass_context
def reconcile(ctx: click.Context, as_json: bool) -> None:
    """Free the leases of dead owners now.

    One orphan-reconcile pass, as workers run every reconcile_interval: releases the leases
    of owners whose liveness ran out.
    """
    ext = _ext(ctx)
    store = ext.store
    store.ping()  # a Redis that does not answer is an error, not "someone else reconciles"
    if ext.settings.node is None:
        # this process takes the reconcile lease as an owner of its own, never as a worker's
        # node (a worker of that name would free the lease at start-up)
        set_node(default_node("cli"))
    try:
        report = run_reconcile(ext)
    finally:
        try:  # drop this process's own registration again; it holds nothing now
            store.cleanup_owner(ext.identity().owner, dead=True)
        except LeaseError as exc:
            logger.debug("leases: could not forget the cli's owner: %s", exc)
    if report is None:
        holders = store.holders(RECONCILE_RESOURCE)
        if not holders:
            raise _BackendFailure("the reconcile could not start (see the error above)")
        by = ", ".join(h.owner for h in holders)
        raise _TryAgain(f"another process is reconciling ({by}); try again later")
    if as_json:
        _echo_json(
            {
                "owners": report.owners,
                "released": [{"owner": o, "resource": r} for o, r in report.released],
                "expired": report.expired,
                "kept": [{"owner": o, "entry": e} for o, e in report.kept],
                "errors": [{"owner": o, "error": e} for o, e in report.errors],
            }
        )
    else:
        click.echo(
            f"reconciled {len(report.owners)} owner(s) whose liveness ran out: released "
            f"{len(report.released)} lease(s), removed {report.expired} stale registry "
            f"entr{'y' if report.expired == 1 else 'ies'}"
        )
        for owner, resource in report.released:
            click.echo(f"  released {printable(resource)} of {owner}")
        for owner, entry in report.kept:
            click.echo(f"  kept an unreadable registry entry of {owner}: {entry!r}")
        for owner, error in report.errors:
            click.echo(f"  could not clean {owner}: {error}", err=True)
    if report.errors:
        ctx.exit(1)


@leases.command("stats", cls=_Command)
@_json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Count owners and leases, per node.

    Owners alive and dead, leases held (exclusive, shared) and stale registry entries.
    """
    census = _census(_ext(ctx).store)
    nodes: dict[str, dict[str, int]] = {}

    def node(owner: str) -> dict[str, int]:
        return nodes.setdefault(
            node_of_owner(owner),
            {"owners_alive": 0, "owners_dead": 0, "exclusive": 0, "shared": 0, "stale": 0},
        )

    for owner, liveness in census.liveness.items():
        node(owner)["owners_alive" if liveness is not None and liveness > 0 else "owners_dead"] += 1
    for row in census.held:
        node(row.owner)["exclusive" if row.mode == "x" else "shared"] += 1
    for owner, n in census.stale.items():
        node(owner)["stale"] += n
    total = {k: sum(n[k] for n in nodes.values()) for k in ("owners_alive", "owners_dead")}
    exclusive = sum(n["exclusive"] for n in nodes.values())
    shared = sum(n["shared"] for n in nodes.values())
    stale = sum(census.stale.values())
    if as_json:
        _echo_json(
            {
                "owners": {"alive": total["owners_alive"], "dead": total["owners_dead"]},
                "leases": {"held": exclusive + shared, "exclusive": exclusive, "shared": shared},
                "stale_entries": stale,
                "queued_claims": len(census.queued),
                "nodes": dict(sorted(nodes.items())),
            }
        )
        return
    click.echo(f"owners: {total['owners_alive']} alive, {total['owners_dead']} dead")
    click.echo(
        f"leases: {exclusive + shared} held ({exclusive} exclusive, {shared} shared), "
        f"{stale} stale registry entr{'y' if stale == 1 else 'ies'}"
    )
    if census.queued:
        click.echo(f"unique claims queued (tasks not started): {len(census.queued)}")
    if nodes:
        click.echo("")
        rows = (
            [name, n["owners_alive"], n["owners_dead"], n["exclusive"], n["shared"], n["stale"]]
            for name, n in sorted(nodes.items())
        )
        headers = ("NODE", "ALIVE", "DEAD", "EXCLUSIVE", "SHARED", "STALE")
        click.echo(_table(headers, rows))


@leases.command("audit", cls=_Command)
@click.option(
    "-n",
    "--last",
    "last",
    type=click.IntRange(1, AUDIT_KEEP),
    default=20,
    show_default=True,
    allow_from_autoenv=False,
    help="How many of the newest records to show.",
)
@_json_option
@click.pass_context
def audit(ctx: click.Context, last: int, as_json: bool) -> None:
    """Show the last releases made with `release`.

    Newest first; `forced` says the owner was alive when it was released.
    """
    records = _ext(ctx).store.audit_log(last)
    if as_json:
        _echo_json(records)
    elif not records:
        click.echo("no releases recorded")
    else:
        keys = ("at", "by", "resource", "owner", "task_id", "forced", "released")
        rows = ([_cell(record.get(k)) for k in keys] for record in records)
        click.echo(_table([k.upper() for k in keys], rows))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


class _WebData:
    """What ``celery leases web`` shows and does: the functions of the commands above."""

    def __init__(self, app: Celery, store: LeaseStore) -> None:
        self.app, self.store = app, store

    def leases(self, *, owner: str | None, pattern: str | None) -> list[dict[str, object]]:
        return ls_json(self.app, self.store, owner=owner, pattern=pattern)

    def owners(self) -> list[dict[str, object]]:
        return owners_json(self.store)

    def release(self, resource: str, *, via: str) -> list[dict[str, object]]:
        return force_release_json(self.store, resource, by=f"{_operator()} ({via})")


@leases.command("web", cls=_Command)
@click.option(
    "--bind",
    default="127.0.0.1:8765",
    show_default=True,
    metavar="HOST:PORT",
    allow_from_autoenv=False,
    help="Where to listen; a loopback address unless --public.",
)
@click.option(
    "--public",
    is_flag=True,
    allow_from_autoenv=False,
    help="Allow a --bind address that is not loopback (anyone who reaches it sees the leases).",
)
@click.option(
    "--allow-release",
    is_flag=True,
    allow_from_autoenv=False,
    help="Offer the forced release (POST /api/leases/release); needs --token or --token-file.",
)
@click.option(
    "--token",
    metavar="TOKEN",
    allow_from_autoenv=False,
    help="The bearer token a release needs (visible in ps: prefer --token-file).",
)
@click.option(
    "--token-file",
    type=click.File("r"),
    allow_from_autoenv=False,
    help="Read the bearer token from this file (its first line).",
)
@click.pass_context
def web(
    ctx: click.Context,
    bind: str,
    public: bool,
    allow_release: bool,
    token: str | None,
    token_file: Any,
) -> None:
    """Serve a live web view of the leases (needs the extra `web`).

    Read-only unless --allow-release; see celery_leases.web for its pages and endpoints.
    """
    try:
        from . import web as view
    except ImportError as exc:
        msg = f"the web view needs the extra 'web' (pip install 'celery-leases[web]'): {exc}"
        raise _Failure(msg) from None
    if token_file is not None:
        if token is not None:
            raise click.UsageError("give --token or --token-file, not both")
        token = token_file.readline().strip()
    if token is not None and not token.strip():
        raise click.UsageError("the token must not be empty")
    if allow_release and token is None:
        raise click.UsageError("--allow-release needs --token or --token-file")
    try:
        where = view.check_bind(bind, public=public)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    app = _app(ctx)
    ext = _ext(ctx)
    ext.store.ping()  # a Redis that does not answer is an error at start-up, not on the page
    entries = sorted(str(name) for name in (app.conf.beat_schedule or {}))
    asgi = view.create_app(
        ext.store,
        _WebData(app, ext.store),
        bind=where,
        token=token,
        allow_release=allow_release,
        beat_entries=entries,
    )
    if not where.loopback:
        logger.warning(
            "leases: the web view listens on %s, not a loopback address: anyone who reaches "
            "it sees every lease",
            bind,
        )
    mode = "forced release enabled (bearer token)" if allow_release else "read-only"
    click.echo(f"celery leases web: {where.url}/ ({mode})", err=True)
    view.serve(asgi, where)


# --- a worker whose tasks carry lease options nothing would read -----------------------------
def unleased_problem(app: Celery) -> str | None:
    """Why a worker of ``app`` must not start: tasks that set lease options on an app without
    ``Leases(app)`` (nothing would take their leases); None when there are none."""
    if find_leases(app) is not None:
        return None
    tasks = unleased_tasks(app)
    if not tasks:
        return None
    listed = "; ".join(f"{name} ({', '.join(options)})" for name, options in tasks.items())
    which = "the task" if len(tasks) == 1 else "the tasks"
    return (
        f"celery_leases: refusing to start: {which} {listed} of app {app.main!r} set lease "
        "options, but the app has no Leases(app), so nothing would take their leases and "
        "copies would run at once. Create it next to the app (from celery_leases import "
        "Leases; Leases(app)), or declare them with base=LeasedTask. See "
        "docs/tasks.md#without-baseleasedtask."
    )


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """``worker_init``: refuse to start (exit 78) a worker whose tasks carry lease options on
    an app without ``Leases(app)``.

    The exception to "a handler never raises": it ends the process on purpose, with
    ``SystemExit``, which Celery's signal dispatch does not swallow. Anything else that goes
    wrong here is logged and the worker starts.
    """
    try:
        problem = unleased_problem(sender.app)
    except Exception:
        logger.exception("leases: could not check the worker's tasks for lease options")
        return
    if problem is not None:
        click.echo(problem, err=True)
        raise SystemExit(EX_CONFIG)


# The style exception of this module (docs/architecture.md, "Rules"): importing it connects a
# signal. Celery's CLI imports this module, the package's celery.commands entry point, in every
# `celery` process, so a `celery worker` sees tasks whose lease options an app without
# Leases(app) would silently ignore, even when the app's code never imports celery_leases.
_signals.worker_init.connect(on_worker_init, dispatch_uid="celery_leases.unleased", weak=False)
