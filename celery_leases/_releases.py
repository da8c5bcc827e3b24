"""Releases, written once: a holder's release, a cleanup's, and the give-back of a grant.

One release.lua call per owner and slot group; a lost reply is sent again (release is
idempotent) and ``_lostreply.release_recovered`` says what the lost run freed. No I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._lease import Held
from ._lostreply import BOOK, release_recovered
from ._protocol import (
    Failure,
    Script,
    Send,
    Steps,
)
from ._registry import TICKET_SLACK_MS, Entry, counted_held, held_entry, ticket_text
from ._scripts import ReleaseReply
from .exceptions import LeaseBackendError

if TYPE_CHECKING:
    from ._engine import LeaseEngine


logger = logging.getLogger(__name__)


def release(engine: LeaseEngine, held: Sequence[Held], now: float) -> Steps[list[bool]]:
    """Release ``held`` (any owners); True for each lease that was still ours.

    One script call per (owner, slot group). Idempotent: releasing a lease again, or one that
    already ran out, returns False and changes nothing but the registry entry. ``now``: the
    monotonic time, to tell which leases still counted as held (see release_recovered).
    """
    if len(held) == 1:  # the hot path
        h = held[0]
        entry = release_entry(engine, h)
        counted = [counted_held(h, now)]
        return (yield from release_entries(engine, h.owner, h.group, [entry], counted))
    out: dict[int, bool] = {}
    groups: dict[tuple[str, int], list[int]] = {}
    for i, h in enumerate(held):
        groups.setdefault((h.owner, h.group), []).append(i)
    for (owner, group), idx in groups.items():
        entries = [release_entry(engine, held[i]) for i in idx]
        counted = [counted_held(held[i], now) for i in idx]
        freed = yield from release_entries(engine, owner, group, entries, counted)
        out.update(zip(idx, freed, strict=True))
    return [out[i] for i in range(len(held))]


def release_quietly(engine: LeaseEngine, held: Sequence[Held]) -> Steps[None]:
    """Release ``held`` where a failure has nobody to tell: it runs out by its TTL (and
    the owner registry lets a cleanup free it sooner)."""
    try:
        yield from release(engine, held, time.monotonic())
    except LeaseBackendError as exc:
        logger.error("leases: could not release %d lease(s): %s", len(held), exc)


def release_entry(engine: LeaseEngine, held: Held) -> Entry:
    """The registry entry of ``held``, to release it; for a lease handed to it, with the
    ticket it was handed to (release.lua takes it out of the handed ZSET)."""
    entry = held_entry(held)
    if held.ticket:
        text = ticket_text(held.ticket, engine.ms(held.ttl), held.task_id, held.owner)
        entry = entry._replace(handed="x" + text)
    return entry


def release_entries(
    engine: LeaseEngine,
    owner: str,
    group: int,
    entries: Sequence[Entry],
    counted: Sequence[bool] | None = None,
    event: str = "released",
    by: str = "",
) -> Steps[list[bool]]:
    """release.lua for ``entries`` of ``owner`` in ``group``; True for each that was held.

    ``event`` and ``by``: what the history records for a lease freed now (``released`` by
    its holder; ``freed`` by a cleanup, the reaper or a reconcile; ``forced`` by an operator).
    See :func:`release_codes`.
    """
    codes = yield from release_codes(engine, owner, group, entries, counted, event, by)
    return [code == ReleaseReply.RELEASED for code in codes]


def release_codes(
    engine: LeaseEngine,
    owner: str,
    group: int,
    entries: Sequence[Entry],
    counted: Sequence[bool] | None = None,
    event: str = "released",
    by: str = "",
    spare_from_us: int = 0,
) -> Steps[list[ReleaseReply]]:
    """release.lua for ``entries`` of ``owner`` in ``group``: its reply for each.

    ``spare_from_us`` (Redis time in microseconds; 0: none): a cleanup pass's bound. A lease
    whose token is that or more was granted after the pass looked at the owner, and is
    spared (:attr:`ReleaseReply.SPARED`), its entry kept, whatever the entry says: t0 a
    reconcile reads an owner whose liveness ran out; t1 the owner, alive again, is granted
    R; t2 the pass releases an entry of the owner's that names R (issue 26, part 1).

    ``counted``: whether each still counted as held (None: not known, as in a cleanup).
    Either way the entries' tokens are then dropped from the book (:func:`released`). If the
    driver is abandoned mid-call (an asyncio caller cancelled), they are not: the release
    goes on in its own task, and its tokens stay counted as live leases until it is done.
    """
    call = Script(
        "release",
        release_keys(engine, owner, group, entries),
        release_args(engine, owner, entries, event, by, spare_from_us),
    )
    lost = False
    try:
        try:
            (reply,) = yield Send([call])  # the hot path: resend_if_lost, inlined
        except Failure as failure:
            if not failure.lost:
                raise
            lost = True  # idempotent (token-checked): sent again, the client may retry
            (reply,) = yield Send([call], once=False)
    except Failure as failure:
        released(engine, owner, entries)
        raise engine.backend_error("release", failure) from failure.cause
    released(engine, owner, entries)
    codes = [ReleaseReply(int(x)) for x in reply]
    if lost and counted is not None:
        # the second run finds no lease the lost run released (see release_recovered)
        freed = [x == ReleaseReply.RELEASED for x in codes]
        return [
            ReleaseReply.RELEASED if f else c
            for f, c in zip(release_recovered(freed, counted), codes, strict=True)
        ]
    return codes


def release_keys(
    engine: LeaseEngine, owner: str, group: int, entries: Sequence[Entry]
) -> list[str]:
    """The keys of one release.lua call: the registry and the group's lifetime record, then
    each lease key, its waiter queue (with the tickets' expiry and orders) and its token
    counter (for a handoff)."""
    keys = [engine.registry_key(owner, group), engine.lifetime_key(group)]
    for e in entries:
        rk = engine.resource_keys(e.resource)
        key = rk.exclusive if e.mode == "x" else rk.shared
        keys += (key, rk.waiters, rk.ticket_expiry, rk.handed, rk.counter)
    if engine.history and entries:
        keys.append(engine.keys.history(group))
        for e in entries:
            rk = engine.resource_keys(e.resource)
            keys += (rk.history, rk.record)
    return keys


def release_args(
    engine: LeaseEngine,
    owner: str,
    entries: Sequence[Entry],
    event: str = "released",
    by: str = "",
    spare_from_us: int = 0,
) -> list[Any]:
    """The arguments of one release.lua call (``event``, ``by``: for the history;
    ``spare_from_us``: see :func:`release_codes`)."""
    args: list[Any] = [
        owner,
        engine.waiter_prefix,
        trusted_receivers(engine),
        engine.grace_ms,
        engine.token_memory_ms,
        TICKET_SLACK_MS,
        spare_from_us,
    ]
    for e in entries:
        args += (e.mode, e.token, e.text, engine.resource_keys(e.resource).channel, e.handed)
    if engine.history:  # last, the group's cap (see lua/release.lua)
        hist, rhist, keep = engine.history_args
        args += (rhist, keep, event, by, hist)
    else:
        args.append(0)
    return args


def released(engine: LeaseEngine, owner: str, entries: Sequence[Entry]) -> None:
    """The release of ``entries`` is over (done or failed): no live lease of this process
    has their tokens any more, so a lost reply's recovery may give such a grant back."""
    for e in entries:
        BOOK.drop(owner, engine.resource_keys(e.resource).exclusive, e.token)


def trusted_receivers(engine: LeaseEngine) -> str:
    """ "1" when PUBLISH's count of receivers is exact, so a queued waiter nobody listens
    for is gone (not on a cluster, where a subscriber may sit on another node)."""
    return "0" if engine.cluster else "1"
