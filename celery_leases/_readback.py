"""The read-back of a grant whose reply was lost: adopt it if it is surely the call's, else
give it back (see ``_lostreply.grant_recovery`` for the decision). No I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ._lostreply import BOOK, grant_recovery, parse_holder
from ._protocol import (
    Command,
    Failure,
    Script,
    Send,
    Sleep,
    Steps,
    clock_ms,
    pairs,
)
from ._registry import Entry, parse_entry
from ._releases import release_entries
from .exceptions import LeaseBackendError

if TYPE_CHECKING:
    from ._engine import LeaseEngine
    from ._grants import AcquireCall
    from ._lease import Want


logger = logging.getLogger(__name__)


#: seconds between looks at the grant calls still in flight, in a lost reply's recovery
QUIET_POLL: Final = 0.005


class GrantsInFlight(Exception):
    """A lost grant's recovery found other grant calls of this process still in flight."""


def book_keys(engine: LeaseEngine, wants: Sequence[Want]) -> list[str]:
    """The keys :data:`~celery_leases._lostreply.BOOK` knows ``wants``' grants by."""
    return [engine.resource_keys(w.resource).exclusive for w in wants]


def recover_call(engine: LeaseEngine, call: AcquireCall, lost: Failure) -> Steps[list[int] | None]:
    """:func:`recover_grant` for ``call``; a recovery that fails is logged, and raised.

    The call of a wait that leaves orders: the wait does not count as in flight while it
    recovers its own call (see :func:`~celery_leases._grants.ordering`), and takes no
    handoff on trust after.
    """
    wants = [(w.resource, w.mode) for w in call.wants]
    own: list[str] = []
    if call.order_s and call.ticket is not None:
        own = book_keys(engine, call.wants)
        call.ticket.trusted = False
        BOOK.end(call.owner, own)
    try:
        return (
            yield from recover_grant(
                engine,
                call.owner,
                call.group,
                wants,
                call.task_id,
                adopt_until(engine, call),
                call.call_id,
            )
        )
    except (Failure, GrantsInFlight, LeaseBackendError) as failed:
        log_unrecovered([r for r, _ in wants], lost.cause, failed)
        if isinstance(failed, LeaseBackendError):
            raise
        cause = failed.cause if isinstance(failed, Failure) else failed
        raise engine.backend_error("acquire", cause) from cause
    finally:
        if own:
            BOOK.begin(call.owner, own)


def adopted_call(call: AcquireCall) -> AcquireCall:
    """``call`` as its adopted grant is counted: from its send, or for a wait that leaves
    orders, from its first order's (``Ticket.ordered_at``, earlier): the lease the call found
    may have been handed to the wait by a release before the call was sent."""
    ticket = call.ticket
    if call.order_s and ticket is not None and ticket.ordered_at is not None:
        return call._replace(now=min(call.now, ticket.ordered_at))
    return call


def adopt_until(engine: LeaseEngine, call: AcquireCall) -> float:
    """Until when (monotonic) a lost grant of ``call`` may be adopted rather than given back.

    An adopted lease counts as confirmed when the call was sent, the latest time it can
    have been granted: adopted with little of its horizon left, it would count as lost
    before the heartbeat could renew it. With min_replicas, never (0): the replicas'
    answer was lost too.
    """
    if engine.wait_replicas:
        return 0.0
    return call.now + engine.horizon(call.ttl) / 2


def log_unrecovered(resources: Sequence[str], lost: BaseException, failed: BaseException) -> None:
    """Tell the operator about a grant that may be left behind by a lost reply."""
    if isinstance(failed, Failure):
        failed = failed.cause
    logger.error(
        "leases: the reply to a grant of %s was lost (%s) and it could not be read back "
        "(%s): a grant it made is held until its TTL runs out (the owner's registry "
        "records it, so a cleanup frees it sooner)",
        ", ".join(repr(r) for r in resources),
        lost,
        failed,
    )


def recover_grant(
    engine: LeaseEngine,
    owner: str,
    group: int,
    wants: Sequence[tuple[str, str]],
    task_id: str | None,
    adopt_until: float,
    call_id: str,
) -> Steps[list[int] | None]:
    """After a grant call's reply was lost: its tokens if it granted, else None.

    Waits until no other grant call of this process on these resources is in flight
    (each ends within the socket timeout), reads back this owner's grants of them and its
    registry, and decides with :func:`~celery_leases._lostreply.grant_recovery`: the lost
    call's grant is adopted (returned) only if the registry shows it was made by this very
    call (its entries bear ``call_id``) and Redis still has it; else what the call granted
    (if anything) is released, and None returned (the caller sends the call again). A
    grant that merely looks unclaimed is never adopted nor given back: t0 thread A's grant
    loses its reply; t1 A's recovery reads T, held by sibling thread B of the same owner;
    t2 B releases T; t3 T looks like nobody's, but it is not A's (issue 26, part 8). A
    grant is adopted only until ``adopt_until`` (monotonic; see :func:`adopt_until`).
    Raises Failure if Redis cannot be read, and GrantsInFlight if other calls are still in
    flight after twice the socket timeout.
    """
    book = [engine.resource_keys(r).exclusive for r, _ in wants]
    registry = engine.registry_key(owner, group)
    calls: list[Command | Script] = []
    for resource, _ in wants:
        rk = engine.resource_keys(resource)
        calls += [
            Command(("GET", rk.exclusive)),
            Command(("ZRANGE", rk.shared, 0, -1, "WITHSCORES")),
        ]
    # with the Redis clock, on the registry's node: a shared member that ran out is no grant
    calls += [Command(("SMEMBERS", registry)), Script("now", [registry], [])]
    end = time.monotonic() + 2 * engine.settings.socket_timeout
    while True:
        seq = BOOK.quiet(owner, book)
        if seq is not None:
            *replies, now = yield Send(calls, once=False)  # reads: the client may retry
            if BOOK.unchanged(owner, book, seq):  # see GrantBook
                break
        if time.monotonic() >= end:
            raise GrantsInFlight("other grant calls of this process are still in flight")
        yield Sleep(QUIET_POLL)
    for i in range(len(wants)):
        replies[2 * i + 1] = pairs(replies[2 * i + 1])
    adopted, orphans = settle_lost_grant(owner, wants, replies, clock_ms(now), adopt_until, call_id)
    if orphans:
        yield from release_entries(engine, owner, group, orphans)
    return adopted


def settle_lost_grant(
    owner: str,
    wants: Sequence[tuple[str, str]],
    replies: Sequence[Any],
    now_ms: int,
    adopt_until: float,
    call_id: str,
) -> tuple[list[int] | None, list[Entry]]:
    """What a grant whose reply was lost left, read back: ``(tokens adopted, orphans)``.

    The decision a lost grant's recovery makes once Redis was read quietly (see
    :func:`~celery_leases._lostreply.grant_recovery`): the lost call's grant is adopted if
    the registry entries bearing its ``call_id`` prove it, or those grants (the call's own,
    and only those) are to be released by the caller.
    """
    found, entries = own_grants(owner, [r for r, _ in wants], replies, now_ms)
    mine: dict[str, list[tuple[str, int]]] = {}
    for (resource, mode, token), entry in entries.items():
        if entry.call == call_id:
            mine.setdefault(resource, []).append((mode, token))
    decision = grant_recovery(wants, found, mine, may_adopt=time.monotonic() < adopt_until)
    if decision.adopt is not None:
        logger.info("leases: a grant of %s whose reply was lost is kept", wants[0][0])
        return decision.adopt, []
    orphans = [entries[(r, m, t)] for r, m, t in decision.give_back]
    if orphans:
        logger.info(
            "leases: %d grant(s) whose reply was lost are given back (%s)",
            len(orphans),
            ", ".join(repr(e.resource) for e in orphans),
        )
    return None, orphans


def own_grants(
    owner: str, resources: Sequence[str], replies: Sequence[Any], now_ms: int
) -> tuple[dict[str, list[tuple[str, int]]], dict[tuple[str, str, int], Entry]]:
    """``owner``'s grants in what :func:`recover_grant` read back.

    ``replies``: per resource its exclusive key's value and its shared members with their
    expiry (Redis time in ms, as pairs), then the owner's registry; ``now_ms``: the Redis
    clock after the read. Returns per resource ``(mode, token)`` of the live grants, and the
    registry entries by ``(resource, mode, token)`` (to release them by their exact text).
    """
    found: dict[str, list[tuple[str, int]]] = {}
    for i, resource in enumerate(resources):
        value, members = replies[2 * i], replies[2 * i + 1]
        live = [m for m, score in members if float(score) > now_ms]
        grants = found[resource] = []
        for mode, holder in [("x", value), *(("s", m) for m in live)]:
            parsed = None if holder is None else parse_holder(holder)
            if parsed is not None and parsed[1] == owner:
                grants.append((mode, parsed[0]))
    entries: dict[tuple[str, str, int], Entry] = {}
    for member in replies[-1]:
        entry = parse_entry(str(member))
        if entry is not None:
            entries[(entry.resource, entry.mode, entry.token)] = entry
    return found, entries
