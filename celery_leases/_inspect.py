"""Operator reads and repairs, written once: who holds what, owners, registries, the audit log.

The calls behind ``celery leases ...`` and a busy error's holder. Each walks the owners
index and the owners' registries, never the keyspace, and batches its commands in one
round trip per :data:`OPS_BATCH`. Each is a generator of protocol requests (see
``_protocol``), carried out by either driver. No I/O.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from . import _releases
from ._engine import RESOURCE_HISTORY, LeaseEngine
from ._keys import holder_parts, holder_value, node_of_owner, pid_of_owner, unescape
from ._protocol import Call, Command, Script, Steps, clock_ms, pairs
from ._registry import QUEUED_OWNER, Entry, parse_entry, split_holder, task_in_registry
from .exceptions import LeaseBackendError

__all__ = (
    "OPS_BATCH",
    "AUDIT_KEEP",
    "Holder",
    "audit",
    "audit_log",
    "check_entries",
    "entries",
    "force_release",
    "history",
    "holder_task",
    "holders",
    "lease_record",
    "mark_node_alive",
    "node_alive",
    "node_marks",
    "nodes",
    "owned",
    "owners",
    "parse_event",
    "read_liveness",
    "recent_events",
    "read_registries",
    "registry_task",
    "waiter_counts",
    "with_now",
)

logger = logging.getLogger(__name__)

#: commands per round trip of the operations calls (a fleet may have thousands of owners)
OPS_BATCH: Final = 1000
#: records the audit list keeps (the newest)
AUDIT_KEEP: Final = 1000


@dataclass(frozen=True)
class Holder:
    """One holder of a resource, as Redis records it."""

    resource: str
    mode: str
    token: int
    owner: str
    expires_in: float

    @property
    def node(self) -> str:
        return node_of_owner(self.owner)


def with_now(
    engine: LeaseEngine, what: str, calls: Sequence[Call], key: str
) -> Steps[tuple[list[Any], int]]:
    """``calls`` in one round trip, with the Redis clock in ms: ``(their replies, clock)``.

    The clock is read on the node serving ``key``, by a one-line script: a cluster
    pipeline cannot send TIME (it names no key).
    """
    replies = yield from engine.send(what, [*calls, Script("now", [key], [])])
    now = replies.pop()
    return replies, clock_ms(now)


def _members(reply: Any) -> list[Entry]:
    """The entries of one SMEMBERS reply that can be read (a cleanup keeps the others)."""
    out: list[Entry] = []
    for member in reply or ():
        parsed = parse_entry(str(member))
        if parsed is not None:
            out.append(parsed)
    return out


# --- registries ---------------------------------------------------------------------------
def read_registries(engine: LeaseEngine, owners: Sequence[str]) -> Steps[dict[str, list[Entry]]]:
    """The registry entries of each of ``owners`` (every slot group), by resource name.

    One round trip per :data:`OPS_BATCH` registries. Unreadable entries are left out
    here; a cleanup keeps and reports them.
    """
    out: dict[str, list[Entry]] = {owner: [] for owner in owners}
    keys = [
        (owner, engine.keys.registry(owner, group))
        for owner in out
        for group in range(engine.settings.slot_groups)
    ]
    for start in range(0, len(keys), OPS_BATCH):
        chunk = keys[start : start + OPS_BATCH]
        calls = [Command(("SMEMBERS", key)) for _, key in chunk]
        replies = yield from engine.send("read owner registries", calls)
        for (owner, _), members in zip(chunk, replies, strict=True):
            out[owner] += _members(members)
    for found in out.values():
        found.sort(key=lambda e: (e.resource, e.token))
    return out


def entries(engine: LeaseEngine, owner: str) -> Steps[list[Entry]]:
    """The registry entries of ``owner`` (every slot group), by resource name."""
    calls = [
        Command(("SMEMBERS", engine.keys.registry(owner, group)))
        for group in range(engine.settings.slot_groups)
    ]
    out: list[Entry] = []
    for members in (yield from engine.send("read an owner registry", calls)):
        out += _members(members)
    return sorted(out, key=lambda e: (e.resource, e.token))


def owned(engine: LeaseEngine, owner: str) -> Steps[list[tuple[str, int, str]]]:
    """``(mode, token, resource)`` of what ``owner``'s registries list."""
    return [(e.mode, e.token, e.resource) for e in (yield from entries(engine, owner))]


def registry_task(engine: LeaseEngine, owner: str, resource: str, token: int) -> Steps[str | None]:
    """The task id ``owner``'s registry records for its lease ``resource``/``token``.

    None when the entry is gone (the lease changed hands since it was read) or records
    no task. A registry holds what one process holds, so reading it costs little.
    """
    group = engine.resource_keys(resource).group
    read = Command(("SMEMBERS", engine.registry_key(owner, group)))
    (members,) = yield from engine.send("read an owner registry", [read])
    return task_in_registry(members or (), resource, token)


# --- leases -------------------------------------------------------------------------------
def check_entries(
    engine: LeaseEngine, items: Sequence[tuple[str, Entry]]
) -> Steps[list[tuple[float, int] | None]]:
    """For each ``(owner, entry)``: the seconds left on that lease and its token, or None if
    it is gone.

    A lease is there while its key still names the entry's token and owner (the test
    renew.lua makes; a handed lease's entry names no token: the owner's lease of the
    resource, whatever its token); None means it ran out, was released or was taken over
    since, and the registry entry is stale.
    """
    out: list[tuple[float, int] | None] = []
    for start in range(0, len(items), OPS_BATCH):
        chunk = items[start : start + OPS_BATCH]
        calls: list[Call] = []
        for owner, entry in chunk:
            rk = engine.resource_keys(entry.resource)
            if entry.mode == "x":
                calls += (Command(("GET", rk.exclusive)), Command(("PTTL", rk.exclusive)))
            else:
                calls.append(Command(("ZSCORE", rk.shared, holder_value(entry.token, owner))))
        replies, now_ms = yield from with_now(engine, "inspect leases", calls, engine.keys.owners)
        replies.reverse()
        for owner, entry in chunk:
            if entry.mode == "x":
                value, pttl = replies.pop(), replies.pop()
                parsed = split_holder(value)  # (owner, token) of a holder
                if (
                    isinstance(parsed, tuple)
                    and parsed[0] == owner
                    and entry.token in (0, parsed[1])
                ):
                    out.append((max(int(pttl), 0) / 1000, parsed[1]))
                else:
                    out.append(None)
            else:
                score = replies.pop()
                held = score is not None and float(score) > now_ms
                out.append(((float(score) - now_ms) / 1000, entry.token) if held else None)
    return out


def holders(engine: LeaseEngine, resource: str) -> Steps[list[Holder]]:
    """Who holds ``resource`` now (exclusive holder or live shared holders)."""
    rk = engine.resource_keys(resource)
    xkey, skey = rk.exclusive, rk.shared
    calls = [
        Command(("GET", xkey)),
        Command(("PTTL", xkey)),
        Command(("ZRANGE", skey, 0, -1, "WITHSCORES")),
    ]
    (value, pttl, shared), now_ms = yield from with_now(engine, "inspect a resource", calls, skey)
    out: list[Holder] = []
    if value is not None:
        token, owner = holder_parts(value)
        out.append(Holder(resource, "x", int(token), owner, max(int(pttl), 0) / 1000))
    for member, score in pairs(shared):
        if score > now_ms:
            token, owner = holder_parts(member)
            out.append(Holder(resource, "s", int(token), owner, (score - now_ms) / 1000))
    return out


def holder_task(engine: LeaseEngine, resource: str) -> Steps[str | None]:
    """The task id of the exclusive holder of ``resource``, for a busy error's message.

    Only the busy path pays for it (two reads). None when the resource is held shared,
    not by a task, not at all any more, or when Redis fails: a busy error must stay a
    busy error, not become a backend error over a detail of its message.
    """
    try:
        read = Command(("GET", engine.resource_keys(resource).exclusive))
        (value,) = yield from engine.send("read a lease", [read])
        holder = split_holder(value)
        if holder is None or isinstance(holder, str):
            return holder
        return (yield from registry_task(engine, holder[0], resource, holder[1]))
    except LeaseBackendError as exc:
        logger.debug("leases: could not read the holder of %s: %s", resource, exc)
        return None


def force_release(
    engine: LeaseEngine,
    resource: str,
    holder: Holder,
    *,
    event: str = "forced",
    by: str = "operator",
) -> Steps[bool]:
    """Release ``holder``'s lease on ``resource``, whoever holds it; True if it was held.

    Only that grant goes: the key must still name the holder's token and owner, so a lease
    granted to someone else in between is never touched. The registry entry goes too, and
    waiters are woken. A live holder learns of it at its next renewal (``LeaseLost``).
    ``event``/``by``: what the history records (``forced``, or ``freed`` for a dead owner's).
    """
    # the registry entry as written (with its task id, and the grant call's id)
    entry = next(
        (
            e
            for e in (yield from entries(engine, holder.owner))
            if (e.resource, e.mode, e.token) == (resource, holder.mode, holder.token)
        ),
        Entry(holder.mode, holder.token, None, resource),
    )
    group = engine.resource_keys(resource).group
    freed = yield from _releases.release_entries(
        engine, holder.owner, group, [entry], event=event, by=by
    )
    return freed[0]


# --- owners and nodes ---------------------------------------------------------------------
def read_liveness(engine: LeaseEngine, owners: Sequence[str]) -> Steps[dict[str, float | None]]:
    """Seconds left on each owner's liveness (negative: it ran out; None: not registered)."""
    out: dict[str, float | None] = {}
    unique = list(dict.fromkeys(owners))
    key = engine.keys.owners
    for start in range(0, len(unique), OPS_BATCH):
        chunk = unique[start : start + OPS_BATCH]
        read = Command(("ZMSCORE", key, *chunk))
        (scores,), now_ms = yield from with_now(engine, "read owner liveness", [read], key)
        for owner, score in zip(chunk, scores, strict=True):
            out[owner] = None if score is None else (float(score) - now_ms) / 1000
    return out


def owners(engine: LeaseEngine) -> Steps[list[tuple[str, float]]]:
    """Every registered owner and the seconds left on its liveness (negative: dead)."""
    key = engine.keys.owners
    read = Command(("ZRANGE", key, 0, -1, "WITHSCORES"))
    (members,), now_ms = yield from with_now(engine, "list owners", [read], key)
    return [(m, (s - now_ms) / 1000) for m, s in pairs(members)]


def nodes(engine: LeaseEngine) -> Steps[list[str]]:
    """Every node that has registered owners."""
    (members,) = yield from engine.send("list nodes", [Command(("SMEMBERS", engine.keys.nodes))])
    return sorted(unescape(str(n)) for n in members or ())


# --- audit --------------------------------------------------------------------------------
def audit(engine: LeaseEngine, record: Mapping[str, object]) -> Steps[None]:
    """Append ``record`` (JSON-serialisable) to the audit list; the newest are kept."""
    text = json.dumps(dict(record), sort_keys=True)
    key = engine.keys.audit
    calls = [Command(("LPUSH", key, text)), Command(("LTRIM", key, 0, AUDIT_KEEP - 1))]
    yield from engine.send("write the audit log", calls, transaction=True)


def audit_log(engine: LeaseEngine, n: int) -> Steps[list[dict[str, Any]]]:
    """The last ``n`` audit records, newest first (an unreadable one as ``{"raw": text}``)."""
    if n <= 0:
        return []
    read = Command(("LRANGE", engine.keys.audit, 0, n - 1))
    (texts,) = yield from engine.send("read the audit log", [read])
    out: list[dict[str, Any]] = []
    for text in texts or ():
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        out.append(record if isinstance(record, dict) else {"raw": str(text)})
    return out


# --- the lease record and the history -----------------------------------------------------
_MODE_WORDS: Final = {"x": "exclusive", "s": "shared"}


def _fields(flat: Any) -> dict[str, str]:
    """A stream entry's ``[field, value, ...]`` (or a mapping) as a dict of texts."""
    if isinstance(flat, Mapping):
        return {str(k): str(v) for k, v in flat.items()}
    items = [str(x) for x in flat or ()]
    return dict(zip(items[::2], items[1::2], strict=True))


def _id_key(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


def parse_event(event_id: object, flat: Any) -> dict[str, Any]:
    """One history stream entry (as acquire.lua, release.lua or a renewal wrote it) as a dict.

    ``event``, ``resource``, ``mode``, ``at`` (the Redis clock, epoch seconds, from the
    entry's id), ``owner``, ``node``, ``pid``, ``task_id``, ``token`` (None for ``busy``),
    and, where written, ``by`` (who freed it), ``ttl`` (a grant's, in seconds) and ``wait``
    (seconds a busy attempt was told to wait).
    """
    ident = str(event_id)
    f = _fields(flat)
    entry = parse_entry(f.get("x", ""))
    owner = f.get("o") or None
    out: dict[str, Any] = {
        "id": ident,
        "event": f.get("e", "?"),
        "resource": None if entry is None else entry.resource,
        "mode": None if entry is None else _MODE_WORDS.get(entry.mode),
        "at": _id_key(ident)[0] / 1000,
        "owner": owner,
        "node": None if owner is None else node_of_owner(owner),
        "pid": None if owner is None else pid_of_owner(owner),
        "task_id": None if entry is None else entry.task_id,
        "token": None if entry is None or not entry.token else entry.token,
    }
    if f.get("by"):
        out["by"] = f["by"]
    if "ttl" in f:
        out["ttl"] = int(f["ttl"]) / 1000
    if "w" in f:
        out["wait"] = int(f["w"]) / 1000
    return out


def _events(reply: Any) -> list[dict[str, Any]]:
    return [parse_event(event_id, flat) for event_id, flat in reply or ()]


def history(
    engine: LeaseEngine, *, resource: str | None = None, node: str | None = None, count: int = 50
) -> Steps[list[dict[str, Any]]]:
    """The last ``count`` events, newest first: of ``resource`` (its own stream), or of the
    whole fleet (every slot group's stream, merged by time); only ``node``'s with ``node``.

    Empty, and nothing read, when the ``history`` setting is 0 (nothing was written; a
    reader must run with the writers' setting). See :func:`parse_event`
    for the fields of an event.
    """
    if count <= 0 or not engine.history:
        return []
    if resource is not None:
        key = engine.resource_keys(resource).history
        size = count if node is None else RESOURCE_HISTORY
        read = Command(("XREVRANGE", key, "+", "-", "COUNT", size))
        (reply,) = yield from engine.send("read a resource's history", [read])
        found = [e for e in _events(reply) if node is None or e["node"] == node]
        return found[:count]
    streams = [engine.keys.history(g) for g in range(engine.settings.slot_groups)]
    merged: list[dict[str, Any]] = []
    ends = dict.fromkeys(streams, "+")
    left = {key: count for key in streams}
    while ends:
        size = count if node is None else max(count, OPS_BATCH)
        calls = [Command(("XREVRANGE", key, end, "-", "COUNT", size)) for key, end in ends.items()]
        replies = yield from engine.send("read the history", calls)
        for key, reply in zip(list(ends), replies, strict=True):
            events = _events(reply)
            kept = [e for e in events if node is None or e["node"] == node][: left[key]]
            merged += kept
            left[key] -= len(kept)
            if node is None or len(events) < size or left[key] <= 0:
                del ends[key]  # read enough of this group, or all it keeps
            else:
                ends[key] = "(" + events[-1]["id"]
    merged.sort(key=lambda e: _id_key(e["id"]), reverse=True)
    return merged[:count]


def lease_record(engine: LeaseEngine, resource: str) -> Steps[dict[str, Any]]:
    """What is known of ``resource`` now: its holders, since when, its waiters, its history.

    ``granted_at`` (epoch seconds) is derived from the fencing token: a token is at least
    the Redis clock in microseconds at its grant, so the grant was made at or before
    ``token / 1e6`` (and, in practice, within a microsecond of it). ``renewed_at`` needs the
    lease's ttl, which only the history records (a grant's event, or the resource's record
    of its last grant): ``now - (ttl - ttl left)``. ``transitions`` (grants of the resource
    since its record was made) and ``history`` need the ``history`` setting too; without it
    they are None and []. ``waiters``: the live tickets of its waiter queue. For a resource
    held shared, ``granted_at`` is the oldest holder's and ``renewed_at`` the latest
    renewal's.
    """
    rk = engine.resource_keys(resource)
    calls = [
        Command(("GET", rk.exclusive)),
        Command(("PTTL", rk.exclusive)),
        Command(("ZRANGE", rk.shared, 0, -1, "WITHSCORES")),
        Command(("ZRANGE", rk.ticket_expiry, 0, -1, "WITHSCORES")),
    ]
    if engine.history:  # read only where written (a user's ACL may allow no more)
        calls += [
            Command(("HGETALL", rk.record)),
            Command(("XREVRANGE", rk.history, "+", "-", "COUNT", RESOURCE_HISTORY)),
        ]
    replies, now_ms = yield from with_now(engine, "read a lease record", calls, rk.exclusive)
    value, pttl, shared, tickets, *kept = replies
    record = _fields(kept[0]) if kept else {}
    past = _events(kept[1]) if kept else []
    grant_ttls = {e["token"]: e["ttl"] for e in past if e["event"] == "granted" and "ttl" in e}
    last_ttl = int(record["ttl"]) / 1000 if "ttl" in record else None
    now = now_ms / 1000
    # (mode, token, owner or None, queued task id, seconds left)
    found: list[tuple[str, int, str | None, str | None, float]] = []
    if value is not None:
        holder = split_holder(value)
        left = max(int(pttl), 0) / 1000
        if isinstance(holder, tuple):
            found.append(("x", holder[1], holder[0], None, left))
        elif str(value).partition(" ")[2].startswith(QUEUED_OWNER):  # a unique claim, queued
            text = holder_parts(value)[0]
            found.append(("q", int(text) if text.isdigit() else 0, None, holder, left))
    for member, score in pairs(shared):
        if score > now_ms:
            text, who = holder_parts(member)
            if text.isdigit():
                found.append(("s", int(text), who, None, (score - now_ms) / 1000))
    tasks: dict[tuple[str, int], str | None] = {}
    group = rk.group
    owners = sorted({owner for _, _, owner, _, _ in found if owner is not None})
    if owners:
        reads = [Command(("SMEMBERS", engine.registry_key(o, group))) for o in owners]
        registries = yield from engine.send("read owner registries", reads)
        for owner, members in zip(owners, registries, strict=True):
            for mode, token, o, _, _ in found:
                if o == owner:
                    tasks[(owner, token)] = task_in_registry(members or (), resource, token, mode)
    holders: list[dict[str, Any]] = []
    for mode, token, holder_owner, queued_task, left in found:
        ttl = grant_ttls.get(token, last_ttl)
        renewed = None if ttl is None or left > ttl else round(now - (ttl - left), 3)
        if renewed is not None and token:
            # ms clocks against the µs token: a renewal is never before its grant
            renewed = max(renewed, token / 1e6)
        holders.append(
            {
                "owner": holder_owner,
                "node": None if holder_owner is None else node_of_owner(holder_owner),
                "pid": None if holder_owner is None else pid_of_owner(holder_owner),
                "mode": "queued" if mode == "q" else _MODE_WORDS[mode],
                "token": token,
                "task_id": queued_task
                if holder_owner is None
                else tasks.get((holder_owner, token)),
                "task_name": None,
                "ttl_left": round(left, 3),
                "granted_at": token / 1e6 if token else None,
                "renewed_at": renewed,
            }
        )
    modes = {h["mode"] for h in holders}
    granted = [h["granted_at"] for h in holders if h["granted_at"] is not None]
    renewed_all = [h["renewed_at"] for h in holders if h["renewed_at"] is not None]
    return {
        "resource": resource,
        "mode": modes.pop() if len(modes) == 1 else None,
        "holders": holders,
        "granted_at": min(granted) if granted else None,
        "renewed_at": max(renewed_all) if renewed_all else None,
        "transitions": int(record["transitions"]) if "transitions" in record else None,
        "waiters": sum(1 for _, score in pairs(tickets) if score > now_ms),
        "now": now,
        "history": past,
    }


def waiter_counts(engine: LeaseEngine, resources: Sequence[str]) -> Steps[list[int]]:
    """The live tickets in the waiter queue of each of ``resources`` (one round trip per
    :data:`OPS_BATCH`)."""
    out: list[int] = []
    for start in range(0, len(resources), OPS_BATCH):
        chunk = resources[start : start + OPS_BATCH]
        calls: list[Call] = [
            Command(("ZRANGE", engine.resource_keys(r).ticket_expiry, 0, -1, "WITHSCORES"))
            for r in chunk
        ]
        key = engine.keys.owners
        replies, now_ms = yield from with_now(engine, "read waiter queues", calls, key)
        out += [sum(1 for _, score in pairs(reply) if score > now_ms) for reply in replies]
    return out


def recent_events(
    engine: LeaseEngine, seconds: float, limit: int = 10_000
) -> Steps[tuple[list[dict[str, Any]], float]]:
    """The fleet's events of the last ``seconds`` (at most ``limit`` per slot group), oldest
    first, and the Redis clock (epoch seconds) they were read at."""
    key = engine.keys.history(0)
    _, now = yield from with_now(engine, "read the clock", [], key)
    since = f"{max(now - int(seconds * 1000), 0)}-0"
    streams = [engine.keys.history(g) for g in range(engine.settings.slot_groups)]
    calls = [Command(("XRANGE", k, since, "+", "COUNT", limit)) for k in streams]
    replies = yield from engine.send("read the history", calls)
    events = [e for reply in replies for e in _events(reply)]
    events.sort(key=lambda e: _id_key(e["id"]))
    return events, now / 1000


def mark_node_alive(engine: LeaseEngine, node: str, incarnation: str) -> Steps[None]:
    """Mark ``node`` alive for the ``ttl`` setting (one SET; idempotent)."""
    key = engine.keys.node_alive(node)
    command = Command(("SET", key, incarnation, "PX", engine.ms(engine.settings.ttl)))
    yield from engine.send("mark the node alive", [command])


def node_marks(engine: LeaseEngine, nodes: Sequence[str]) -> Steps[dict[str, str | None]]:
    """The incarnation each of ``nodes`` marked alive (:func:`mark_node_alive`); None: no mark.

    One round trip of GETs (the marks share a slot group, as every node key does).
    """
    if not nodes:
        return {}
    calls = [Command(("GET", engine.keys.node_alive(node))) for node in nodes]
    replies = yield from engine.send("read the nodes' marks", calls)
    return {
        node: None if reply is None else str(reply)
        for node, reply in zip(nodes, replies, strict=True)
    }


def node_alive(engine: LeaseEngine, node: str) -> Steps[float | None]:
    """Seconds left on ``node``'s mark of life (:func:`mark_node_alive`); None: no mark."""
    read = Command(("PTTL", engine.keys.node_alive(node)))
    (ms,) = yield from engine.send("read a node's mark", [read])
    return None if int(ms) < 0 else int(ms) / 1000
