"""Grants, written once: acquire over slot groups, renew, release, and once's receipts.

Each operation is a generator of protocol requests (see ``_protocol``): it plans its script
calls, reads their replies and chooses the next step, and either driver carries it out
(``LeaseStore.run``, ``AsyncLeaseStore.run``). A lost reply's recovery (``_lostreply``) and
the give-back of a partial grant over several slot groups are written here only. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._engine import LeaseEngine
from ._lease import Held
from ._lostreply import BOOK, release_recovered, resend_if_lost
from ._protocol import Command, Failure, Script, Steps
from ._registry import Entry, counted_held
from ._scripts import CommitReceiptReply, ReleaseReply

__all__ = (
    "commit_receipt",
    "delete_receipt",
    "get_receipt",
    "release",
    "release_entries",
)


# --- release ------------------------------------------------------------------------------
def release(engine: LeaseEngine, held: Sequence[Held], now: float) -> Steps[list[bool]]:
    """Release ``held`` (any owners); True for each lease that was still ours.

    One script call per (owner, slot group). Idempotent: releasing a lease again, or one that
    already ran out, returns False and changes nothing but the registry entry. ``now``: the
    monotonic time, to tell which leases still counted as held (see release_recovered).
    """
    if len(held) == 1:  # the hot path
        h = held[0]
        entry = Entry(h.mode, h.token, h.task_id, h.resource)
        return (
            yield from release_entries(engine, h.owner, h.group, [entry], [counted_held(h, now)])
        )
    out: dict[int, bool] = {}
    groups: dict[tuple[str, int], list[int]] = {}
    for i, h in enumerate(held):
        groups.setdefault((h.owner, h.group), []).append(i)
    for (owner, group), idx in groups.items():
        entries = [
            Entry(held[i].mode, held[i].token, held[i].task_id, held[i].resource) for i in idx
        ]
        counted = [counted_held(held[i], now) for i in idx]
        freed = yield from release_entries(engine, owner, group, entries, counted)
        out.update(zip(idx, freed, strict=True))
    return [out[i] for i in range(len(held))]


def release_entries(
    engine: LeaseEngine,
    owner: str,
    group: int,
    entries: Sequence[Entry],
    counted: Sequence[bool] | None = None,
) -> Steps[list[bool]]:
    """release.lua for ``entries`` of ``owner`` in ``group``; True for each that was held.

    ``counted``: whether each still counted as held (None: not known, as in a cleanup).
    Either way the entries' tokens are then dropped from the book (:func:`released`). If the
    driver is abandoned mid-call (an asyncio caller cancelled), they are not: the release
    goes on in its own task, and its tokens stay counted as live leases until it is done.
    """
    call = Script(
        "release", release_keys(engine, owner, group, entries), release_args(engine, owner, entries)
    )
    try:
        (reply,), lost = yield from resend_if_lost([call])
    except Failure as failure:
        released(engine, owner, entries)
        raise engine.backend_error("release", failure) from failure.cause
    released(engine, owner, entries)
    freed = [x == ReleaseReply.RELEASED for x in reply]
    if lost and counted is not None:
        # the second run finds no lease the lost run released (see release_recovered)
        return release_recovered(freed, counted)
    return freed


def release_keys(
    engine: LeaseEngine, owner: str, group: int, entries: Sequence[Entry]
) -> list[str]:
    """The keys of one release.lua call: the registry, then each lease key."""
    keys = [engine.registry_key(owner, group)]
    for e in entries:
        rk = engine.resource_keys(e.resource)
        keys.append(rk.exclusive if e.mode == "x" else rk.shared)
    return keys


def release_args(engine: LeaseEngine, owner: str, entries: Sequence[Entry]) -> list[Any]:
    """The arguments of one release.lua call."""
    args: list[Any] = [owner]
    for e in entries:
        args += (e.mode, e.token, e.text, engine.resource_keys(e.resource).channel)
    return args


def released(engine: LeaseEngine, owner: str, entries: Sequence[Entry]) -> None:
    """The release of ``entries`` is over (done or failed): no live lease of this process
    has their tokens any more, so a lost reply's recovery may give such a grant back."""
    for e in entries:
        BOOK.drop(owner, engine.resource_keys(e.resource).exclusive, e.token)


# --- once receipts ------------------------------------------------------------------------
def get_receipt(engine: LeaseEngine, name: str) -> Steps[str | None]:
    """The stored receipt (JSON text) of ``once(name)``, or None."""
    (value,) = yield from engine.send(
        "read a receipt", [Command(("GET", engine.keys.receipt(name)))]
    )
    return None if value is None else str(value)


def commit_receipt(
    engine: LeaseEngine, name: str, held: Held, receipt: str, ttl: float | None
) -> Steps[bool]:
    """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
    keys = [engine.resource_keys(held.resource).exclusive, engine.keys.receipt(name)]
    args: list[Any] = [f"{held.token} {held.owner}", receipt, 0 if ttl is None else engine.ms(ttl)]
    try:
        # idempotent: the same receipt, stored again while the holder still holds
        (reply,), _ = yield from resend_if_lost([Script("commit_receipt", keys, args)])
    except Failure as failure:
        raise engine.backend_error("store a receipt", failure) from failure.cause
    return int(reply) == CommitReceiptReply.STORED


def delete_receipt(engine: LeaseEngine, name: str) -> Steps[bool]:
    """Delete the receipt of ``once(name)``; True if there was one."""
    command = Command(("DEL", engine.keys.receipt(name)))
    (deleted,) = yield from engine.send("delete a receipt", [command])
    return bool(deleted)
