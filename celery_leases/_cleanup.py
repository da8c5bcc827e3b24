"""Cleanups, written once: an owner's leases freed, a restarted node's, and the orphans'.

Each operation is a generator of protocol requests (see ``_protocol``), carried out by
either driver (its ``run``). A cleanup reads an owner's registries, releases what
they list (through :func:`_releases.release_entries`, in batches) and forgets the owner; the
reconcile pass does so for every owner whose liveness ran out, sparing the leases granted
after that (read against the Redis clocks, :func:`clocks_us`). No I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from . import _releases
from ._engine import LeaseEngine
from ._keys import escaped_node_of_owner, node_of_owner, split_owner, unescape
from ._protocol import Command, Script, Steps, clock_us, pairs
from ._registry import HANDON_MARK, KEEPER, PARKED_OWNER, Entry, HandOn, parse_entry, parse_handon
from ._scripts import ReleaseReply
from .exceptions import LeaseBackendError

__all__ = (
    "CleanupReport",
    "cleanup_node",
    "cleanup_owner",
    "cleanup_owner_isolated",
    "clocks_us",
    "take_over",
    "expired_owner_times",
    "expired_owners",
    "node_owners",
    "reconcile",
    "redis_time",
)

#: leases released per script call by a cleanup (one call blocks Redis for about 8 us each)
_RELEASE_BATCH: Final = 500


@dataclass
class CleanupReport:
    """What a cleanup pass did.

    Attributes:
        owners: owner ids looked at.
        released: ``(owner, resource)`` of leases that were still held and are now free.
        expired: registry entries whose lease had already run out (removed).
        kept: registry entries that could not be understood; kept, never dropped silently.
        errors: ``(owner, message)`` of owners whose cleanup failed; the others went on.
        freed: ``(owner, registry entry)`` of each lease in ``released``, in the same order:
            the entry tells the holding task's id.
        handons: ``(owner, task id, message)`` of each parked task's hand-on that the owner
            recorded and did not publish (it died in between): taken over, its reservation
            extended; the cleaning process publishes the message (see _parking.py).
    """

    owners: list[str] = field(default_factory=list)
    released: list[tuple[str, str]] = field(default_factory=list)
    expired: int = 0
    kept: list[tuple[str, str]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    freed: list[tuple[str, Entry]] = field(default_factory=list)
    handons: list[tuple[str, str, str]] = field(default_factory=list)

    def merge(self, other: CleanupReport) -> None:
        self.owners += other.owners
        self.released += other.released
        self.freed += other.freed
        self.handons += other.handons
        self.expired += other.expired
        self.kept += other.kept
        self.errors += other.errors


# --- one owner ----------------------------------------------------------------------------
def cleanup_owner(
    engine: LeaseEngine,
    owner: str,
    *,
    dead: bool = False,
    granted_before_us: int | None = None,
    clock_offsets_us: Sequence[int] | None = None,
    by: str = "cleanup",
) -> Steps[CleanupReport]:
    """Release every lease ``owner`` still holds, in O(leases it held).

    ``by`` names who frees them in the history (``cleanup``, ``reaper``, ``reconcile``).

    Reads the owner's registry in each slot group (one SMEMBERS each), releases what is
    listed (one script call each), then forgets the owner unless its liveness was
    refreshed meanwhile; ``dead=True`` forgets it regardless (its node restarted).
    Registry entries that cannot be parsed are kept and reported, never dropped.

    With ``granted_before_us`` (Redis time in microseconds), only leases granted before
    it are released: a token is at least the Redis clock of its grant, so an entry with
    a token from then on was granted later, to an owner that is alive again. The bound
    goes to release.lua too (``spare_from``), which checks the token of the lease it would
    free, whatever the entry says: a handed lease's entry (``"h <ticket> ..."``) names no
    token, and a lease granted after the pass is never freed by it (issue 26, part 1). On a
    cluster that time is read on the home group's node while the tokens of group ``g``
    are made on the clock of the node serving ``g``: ``clock_offsets_us[g]`` (see
    :func:`clocks_us`) is added to it for the entries of group ``g``.
    """
    keys = engine.keys
    report = CleanupReport(owners=[owner])
    spared = False
    for group in range(engine.settings.slot_groups):
        registry = keys.registry(owner, group)
        (members,) = yield from engine.send(
            "read an owner registry", [Command(("SMEMBERS", registry))]
        )
        before = granted_before_us
        if before is not None and clock_offsets_us is not None:
            before += clock_offsets_us[group]
        entries: list[Entry] = []
        handons: list[HandOn] = []
        names = sorted(str(m) for m in members or ())
        left = 0  # members that stay: unreadable entries, and leases granted after `before`
        for member in names:
            if member == KEEPER:
                continue
            if member.startswith(HANDON_MARK + " "):
                handon = parse_handon(member)
                if handon is None:
                    report.kept.append((owner, member))
                    left += 1
                elif before is not None and handon.stamp >= before:
                    spared = True  # made after the owner was seen dead: it is alive again
                    left += 1
                else:
                    handons.append(handon)
                continue
            parsed = parse_entry(member)
            if parsed is None:
                report.kept.append((owner, member))
                left += 1
            elif before is not None and parsed.token >= before:
                spared = True
                left += 1
            else:
                entries.append(parsed)
        # in batches, so that a dead owner of thousands of leases never blocks Redis long
        for start in range(0, len(entries), _RELEASE_BATCH):
            batch = entries[start : start + _RELEASE_BATCH]
            codes = yield from _releases.release_codes(
                engine, owner, group, batch, event="freed", by=by, spare_from_us=before or 0
            )
            for entry, code in zip(batch, codes, strict=True):
                if code == ReleaseReply.RELEASED:
                    report.released.append((owner, entry.resource))
                    report.freed.append((owner, entry))
                elif code == ReleaseReply.SPARED:
                    spared = True
                    left += 1
                else:
                    report.expired += 1
        for start in range(0, len(handons), _RELEASE_BATCH):
            batch_h = handons[start : start + _RELEASE_BATCH]
            report.handons += yield from take_over(engine, owner, group, batch_h)
        if not left and KEEPER in names:
            # nothing left but the registry's keeper (see lua/_registry.lua): let the set go
            # (a grant of the owner in between keeps its entry, and makes the set anew with
            # its expiry if this took the last member)
            drop = Command(("SREM", registry, KEEPER))
            yield from engine.send("drop an emptied registry", [drop])
    if not report.kept and not spared:
        node = node_of_owner(owner)
        forget = Script(
            "forget_owner",
            [keys.owners, keys.node(node), keys.nodes],
            [owner, escaped_node_of_owner(owner), "1" if dead else "0"],
        )
        # idempotent (ZREM, SREM): redis-py's own retry may run it twice
        yield from engine.send("forget an owner", [forget])
    return report


def take_over(
    engine: LeaseEngine, owner: str, group: int, handons: Sequence[HandOn]
) -> Steps[list[tuple[str, str, str]]]:
    """Take over the hand-ons that ``owner`` recorded in its registry of ``group`` and did not
    publish: ``(owner, task id, message)`` of each task to publish again (handon_takeover.lua).

    Timeline: t0 a releaser frees R and hands it on to parked task T (R reserved for T, the
    hand-on recorded in its registry); t1 it is killed before it publishes T; t2 a cleanup of
    it (the reaper of its worker, a restart, a reconcile) takes the hand-on over and publishes
    T at once, instead of T waiting for the reservation to run out (``handon_timeout``).
    The same for a pump's hand-on on a rate limit (its hand-on in flight is extended: T
    keeps its turn).
    A lost reply loses those messages: the hand-ons then run out and are handed on again.
    """
    keys = [
        engine.registry_key(owner, group),
        engine.keys.park_state(group),
        engine.keys.park_messages(group),
    ]
    args: list[object] = [PARKED_OWNER, engine.ms(engine.settings.handon_timeout)]
    for handon in handons:
        if handon.mode == "r":  # a rate limit's hand-on: its entry in the limit's FIFO
            fifo = engine.keys.parked_limit(handon.resource)
            keys += (fifo, fifo)
        else:
            rk = engine.resource_keys(handon.resource)
            keys += (rk.exclusive, rk.shared)
        args += (handon.text, handon.task, handon.mode)
    call = Script("handon_takeover", keys, args)
    (reply,) = yield from engine.send("take over a dead owner's hand-ons", [call], once=True)
    return [
        (owner, unescape(handon.task), str(message))
        for handon, message in zip(handons, reply or (), strict=True)
        if message
    ]


def cleanup_owner_isolated(
    engine: LeaseEngine,
    owner: str,
    *,
    dead: bool,
    granted_before_us: int | None = None,
    clock_offsets_us: Sequence[int] | None = None,
    by: str = "cleanup",
) -> Steps[CleanupReport]:
    """:func:`cleanup_owner`, with a failure reported in the result instead of raised."""
    try:
        return (
            yield from cleanup_owner(
                engine,
                owner,
                dead=dead,
                granted_before_us=granted_before_us,
                clock_offsets_us=clock_offsets_us,
                by=by,
            )
        )
    except LeaseBackendError as exc:
        return CleanupReport(owners=[owner], errors=[(owner, str(exc))])


# --- a node, the orphans ------------------------------------------------------------------
def node_owners(engine: LeaseEngine, node: str) -> Steps[list[str]]:
    """The owner ids registered under ``node`` (every incarnation and process)."""
    read = Command(("SMEMBERS", engine.keys.node(node)))
    (members,) = yield from engine.send("list a node's owners", [read])
    return sorted(str(o) for o in members or ())


def cleanup_node(
    engine: LeaseEngine, node: str, *, keep_incarnation: str | None = None
) -> Steps[CleanupReport]:
    """Release every lease of earlier incarnations of ``node`` (a restarted pod).

    A node with no past costs one command (SMEMBERS of its owner set). Each owner is
    cleaned on its own, so one failure does not stop the others.
    """
    owners = yield from node_owners(engine, node)
    report = CleanupReport()
    for owner in owners:
        if split_owner(owner).incarnation == keep_incarnation:
            continue
        report.merge((yield from cleanup_owner_isolated(engine, owner, dead=True)))
    return report


def expired_owners(engine: LeaseEngine, limit: int = 1000) -> Steps[list[str]]:
    """Owners whose liveness ran out (by the Redis clock), oldest first."""
    return [owner for owner, _ in (yield from expired_owner_times(engine, limit))]


def expired_owner_times(engine: LeaseEngine, limit: int) -> Steps[list[tuple[str, int]]]:
    """``(owner, Redis time in ms its liveness ran out)``, oldest first."""
    # a read: redis-py's retry is harmless
    call = Script("expired_owners", [engine.keys.owners], [limit])
    (reply,) = yield from engine.send("list expired owners", [call])
    return [(owner, int(expired_ms)) for owner, expired_ms in pairs(reply)]


def reconcile(engine: LeaseEngine, limit: int = 1000) -> Steps[CleanupReport]:
    """Release the leases of owners whose liveness ran out (orphans), each on its own.

    Only leases granted before the owner's liveness ran out are released. Timeline: t0 an
    idle process's liveness runs out (it holds nothing, so nothing renews it); t1 this
    pass lists it; t2 the process takes a lease, alive again; t3 this pass reaches it and
    must not free the lease of t2.
    """
    report = CleanupReport()
    expired = yield from expired_owner_times(engine, limit)
    offsets = (yield from clocks_us(engine))[1] if expired else None
    for owner, expired_ms in expired:
        report.merge(
            (
                yield from cleanup_owner_isolated(
                    engine,
                    owner,
                    dead=False,
                    granted_before_us=expired_ms * 1000,
                    clock_offsets_us=offsets,
                    by="reconcile",
                )
            )
        )
    return report


# --- clocks -------------------------------------------------------------------------------
def redis_time(engine: LeaseEngine) -> Steps[float]:
    """The Redis server's clock, in Unix seconds: the one clock every worker shares."""
    (reply,) = yield from engine.send("read the clock", [Command(("TIME",))])
    sec, usec = reply
    return int(sec) + int(usec) / 1_000_000


def clocks_us(engine: LeaseEngine) -> Steps[tuple[int, list[int] | None]]:
    """The Redis clock of the home group's node, in microseconds, and per slot group how
    far the clock of the node serving it is ahead of that one, at the least (None off a
    cluster: one clock). A cleanup's ``granted_before_us`` and ``clock_offsets_us``.

    The liveness a reconcile compares tokens with is made on the home group's node; a
    token of group ``g`` on the clock of another node. Timeline, with that node 5 ms
    behind: t0 an idle owner's liveness runs out (home node's clock E); t1 = E + 2 ms the
    owner, alive again, is granted a lease in ``g`` with token E - 3 ms; t2 a reconcile
    frees every lease of that owner granted before E, this one too. Both clocks are read
    in one round trip, and its length is taken off the difference, so the offset is never
    larger than the true one: a lease is then spared rather than wrongly freed.
    """
    if not engine.cluster:
        return math.floor((yield from redis_time(engine)) * 1_000_000), None
    calls = [
        Script("now", [engine.keys.epoch(group)], [])
        for group in range(engine.settings.slot_groups)
    ]
    # the driver sends the round trip between the two readings of the monotonic clock
    start = time.monotonic()
    replies = yield from engine.send("read the cluster's clocks", calls)
    spread_us = math.ceil((time.monotonic() - start) * 1_000_000)
    clocks = [clock_us(reply) for reply in replies]
    return clocks[0], [0] + [clock - clocks[0] - spread_us for clock in clocks[1:]]
