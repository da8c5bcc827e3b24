"""The census of owners and leases that ``celery leases`` prints and its web view serves."""

from __future__ import annotations

import getpass
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from celery.utils.log import get_logger

from ._inspect import Holder
from ._keys import node_of_owner, split_owner, unescape
from ._registry import QUEUED_OWNER, Entry
from ._render import table
from ._revocation import check_revoke
from .config import timing

if TYPE_CHECKING:
    from celery import Celery

    from ._sync.driver import LeaseStore
    from .config import LeaseSettings

#: the CLI's one logger (docs/cli.md names it): a forced release logs here
logger = get_logger("celery_leases.cli")

MODES: Final = {"x": "exclusive", "s": "shared"}
#: how long ls and show wait for the workers to name their tasks, in seconds
_NAMES_TIMEOUT: Final = 1.0


def text_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An aligned table; names escaped, long ones shortened (``--json`` keeps them whole)."""
    return table(headers, rows, limits=LIMITS)


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def seconds(value: float) -> str:
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


def liveness_text(liveness: float | None, renewals: Renewals, *, idle: bool = False) -> str:
    if idle:
        return "idle (holds nothing; its node is alive)"
    state = liveness_state(liveness, renewals)
    if liveness is None:
        return "dead (not registered)"
    if state == "expired":
        return f"dead (expired {seconds(-liveness)} ago)"
    ago = renewed_ago(liveness, renewals)
    if ago is None:
        return f"alive ({seconds(liveness)} left)"
    if state == "late":
        return f"renewed {seconds(ago)} ago, expires in {seconds(liveness)}"
    return f"alive (renewed {seconds(ago)} ago)"


def operator_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in the environment or the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class Row:
    """One held lease, as the commands show it."""

    resource: str
    mode: str  # "x" or "s"
    token: int
    owner: str
    task_id: str | None
    expires_in: float
    liveness: float | None  # seconds left on the owner's liveness; None: not registered
    task_name: str | None = None  # as the owner's live worker tells it (see named)

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
            "mode": "queued" if self.queued else MODES[self.mode],
            "token": self.token,
            "owner": None if self.queued else self.owner,
            "node": None if self.queued else self.node,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "expires_in": rounded(self.expires_in),
            "alive": self.alive,
            "liveness": rounded(self.liveness),
            "status": "queued" if self.queued else liveness_state(self.liveness, renewals),
            "renewed_ago": rounded(ago),
        }

    def cells(self, renewals: Renewals) -> list[object]:
        return [
            self.resource,
            "queued" if self.queued else MODES[self.mode],
            self.token,
            f"{self.expires_in:.1f}s",
            self.node,
            "-" if self.queued else self.owner,
            "queued (not started)" if self.queued else liveness_text(self.liveness, renewals),
            self.task_id or "-",
            self.task_name or "-",
        ]


#: the widest a column of user data is shown, in terminal columns (``--json``: whole)
LIMITS: Final = {
    "RESOURCE": 60,
    "NODE": 40,
    "OWNER": 64,
    "TASK_ID": 40,
    "TASK": 48,
    "BY": 40,
}

ROW_HEADERS: Final = (
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
class Census:
    """Every registered owner, its liveness, and what its registry lists (held or stale)."""

    liveness: dict[str, float | None]
    held: list[Row]
    stale: dict[str, int]  # owner -> registry entries whose lease is gone
    queued: list[Row]  # claims of unique tasks not started yet (held by no process)


def take_census(
    store: LeaseStore, *, owner: str | None = None, pattern: str | None = None
) -> Census:
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
    held: list[Row] = []
    stale: dict[str, int] = {}
    for (o, e), found in zip(items, store.check_entries(items), strict=True):
        if found is None:
            stale[o] = stale.get(o, 0) + 1
        else:
            expires_in, token = found
            held.append(Row(e.resource, e.mode, token, o, e.task_id, expires_in, liveness[o]))
    held.sort(key=lambda r: (r.resource, r.token, r.owner))
    queued: list[Row] = []
    if owner is None:
        for claim in store.queued_claims():
            resource = store.keys.unique_resource(claim.key)
            if pattern is not None and not fnmatchcase(resource, pattern):
                continue
            pseudo_owner = f"{QUEUED_OWNER}{claim.task_id}"
            expires_in = claim.expires_in or 0.0  # queued claims always have a TTL
            queued.append(
                Row(resource, "x", claim.token, pseudo_owner, claim.task_id, expires_in, None)
            )
    return Census({o: liveness[o] for o in owners}, held, stale, queued)


def holder_rows(store: LeaseStore, resource: str) -> list[Row]:
    """The holders of ``resource``, with their owners' liveness and task ids (none: [])."""
    holders = store.holders(resource)
    if not holders:
        return []
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
            Row(resource, h.mode, h.token, h.owner, task_id, h.expires_in, liveness[h.owner])
        )
    return rows


def ls_rows(
    app: Celery, store: LeaseStore, *, owner: str | None = None, pattern: str | None = None
) -> list[Row]:
    """The rows of ``ls``: held leases and queued unique claims, by resource, named."""
    census = take_census(store, owner=owner, pattern=pattern)
    rows = sorted(census.held + census.queued, key=lambda r: (r.resource, r.token, r.owner))
    return named(app, rows)


def ls_json(
    app: Celery, store: LeaseStore, *, owner: str | None = None, pattern: str | None = None
) -> list[dict[str, object]]:
    """What ``ls --json`` prints (the web view's ``GET /api/leases`` serves the same)."""
    renewals = Renewals.of(store.settings)
    return [row.as_json(renewals) for row in ls_rows(app, store, owner=owner, pattern=pattern)]


def named(app: Celery, rows: list[Row]) -> list[Row]:
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


def lease_counts(census: Census) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in census.held:
        counts[row.owner] = counts.get(row.owner, 0) + 1
    return counts


def idle_owners(store: LeaseStore, census: Census, renewals: Renewals) -> set[str]:
    """The owners that are idle: late or expired, holding nothing, their node alive.

    A process renews its liveness only while it holds a lease, so a healthy worker's idle
    pool processes run out of it. Their worker's main process marks the node alive at every
    reaper pass (what ``health --node`` reads), with its incarnation: an owner of that
    incarnation that holds nothing is idle, not dead. One of an older incarnation (a worker
    restarted since) is dead all the same.
    """
    counts = lease_counts(census)
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


def owner_objects(
    census: Census, renewals: Renewals, idle: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, object]]:
    counts = lease_counts(census)
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
                "liveness": rounded(liveness),
                "alive": liveness is not None and liveness > 0,
                "status": "idle" if owner in idle else liveness_state(liveness, renewals),
                "renewed_ago": rounded(renewed_ago(liveness, renewals)),
                "leases": counts.get(owner, 0),
            }
        )
    return out


def owners_json(store: LeaseStore) -> list[dict[str, object]]:
    """What ``owners --json`` prints (the web view's ``GET /api/owners`` serves the same)."""
    census, renewals = take_census(store), Renewals.of(store.settings)
    return owner_objects(census, renewals, idle_owners(store, census, renewals))


def release_rows(
    store: LeaseStore, resource: str, rows: Sequence[Row], *, by: str
) -> list[tuple[Row, bool]]:
    """Free each of ``rows`` (holders of ``resource``), log and audit it: ``(row, freed)``.

    The one forced release: ``release`` calls it once the operator agreed, and so does the
    web view's ``POST /api/leases/release``.
    """
    out: list[tuple[Row, bool]] = []
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
                "mode": MODES[row.mode],
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
    rows = holder_rows(store, resource)
    renewals = Renewals.of(store.settings)
    return [
        {**row.as_json(renewals), "released": freed}
        for row, freed in release_rows(store, resource, rows, by=by)
    ]


def revoke_json(
    store: LeaseStore, resource: str, *, reason: str, deadline: float | None, by: str
) -> dict[str, object]:
    """Revoke every grant on ``resource`` (``leases.revoke``), logged with who asked.

    The one operator's revocation: ``celery leases revoke`` and the web view's
    ``POST /api/leases/revoke`` call it. ``deadline`` None: the ``ttl`` setting.
    """
    deadline = store.settings.ttl if deadline is None else deadline
    check_revoke(resource, reason, deadline)
    done = store.revoke(resource, reason, deadline)
    if done.holders:
        logger.warning(
            "leases: revoked %s held by %s (%s), by %s; it runs out in %.1fs unless released",
            resource,
            ", ".join(done.holders),
            reason or "no reason given",
            by,
            done.deadline,
        )
    return {
        "resource": resource,
        "holders": [
            {"owner": owner, "node": node_of_owner(owner), "token": token}
            for owner, token in zip(done.holders, done.tokens, strict=True)
        ],
        "deadline": round(done.deadline, 3),
        "reason": reason,
    }


class CensusData:
    """What ``celery leases web`` shows and does (``web.WebData``): the commands' functions."""

    def __init__(self, app: Celery, store: LeaseStore) -> None:
        self.app, self.store = app, store

    def leases(self, *, owner: str | None, pattern: str | None) -> list[dict[str, object]]:
        return ls_json(self.app, self.store, owner=owner, pattern=pattern)

    def owners(self) -> list[dict[str, object]]:
        return owners_json(self.store)

    def parked(self) -> dict[str, int]:
        from ._parked import parked_counts  # the integration layer: imported when used
        from .app import find_leases

        ext = find_leases(self.app)
        return {} if ext is None else parked_counts(ext)

    def release(self, resource: str, *, via: str) -> list[dict[str, object]]:
        return force_release_json(self.store, resource, by=f"{operator_name()} ({via})")

    def revoke(
        self, resource: str, *, reason: str, deadline: float | None, via: str
    ) -> dict[str, object]:
        by = f"{operator_name()} ({via})"
        return revoke_json(self.store, resource, reason=reason, deadline=deadline, by=by)
