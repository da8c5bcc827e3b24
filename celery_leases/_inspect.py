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

from . import _grants
from ._engine import LeaseEngine
from ._keys import holder_parts, holder_value, node_of_owner, unescape
from ._protocol import Call, Command, Script, Steps, clock_ms, pairs
from ._registry import Entry, parse_entry, split_holder, task_in_registry
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
    "holder_task",
    "holders",
    "nodes",
    "owned",
    "owners",
    "read_liveness",
    "read_registries",
    "registry_task",
    "with_now",
)

logger = logging.getLogger("celery_leases._store")

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
) -> Steps[list[float | None]]:
    """For each ``(owner, entry)``: the seconds left on that lease, or None if it is gone.

    A lease is there while its key still names the entry's token and owner (the test
    renew.lua makes); None means it ran out, was released or was taken over since, and
    the registry entry is stale.
    """
    out: list[float | None] = []
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
                held = value is not None and str(value) == holder_value(entry.token, owner)
                out.append(max(int(pttl), 0) / 1000 if held else None)
            else:
                score = replies.pop()
                held = score is not None and float(score) > now_ms
                out.append((float(score) - now_ms) / 1000 if held else None)
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


def force_release(engine: LeaseEngine, resource: str, holder: Holder) -> Steps[bool]:
    """Release ``holder``'s lease on ``resource``, whoever holds it; True if it was held.

    Only that grant goes: the key must still name the holder's token and owner, so a lease
    granted to someone else in between is never touched. The registry entry goes too, and
    waiters are woken. A live holder learns of it at its next renewal (``LeaseLost``).
    """
    task_id = next(
        (
            e.task_id
            for e in (yield from entries(engine, holder.owner))
            if (e.resource, e.mode, e.token) == (resource, holder.mode, holder.token)
        ),
        None,
    )
    entry = Entry(holder.mode, holder.token, task_id, resource)
    group = engine.resource_keys(resource).group
    return (yield from _grants.release_entries(engine, holder.owner, group, [entry]))[0]


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
