"""Grants, written once: acquire over slot groups, renew, release, and once's receipts.

Each operation is a generator of protocol requests (see ``_protocol``): it plans its script
calls, reads their replies and chooses the next step, and either driver carries it out
(its ``run``). A lost reply's recovery (``_lostreply``) and the give-back of a partial
grant over several slot groups are written here only. No I/O.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ._keys import escape, escaped_node_of_owner, holder_value, unescape
from ._lease import Held, Want
from ._lostreply import BOOK, grant_recovery, parse_holder, release_recovered, resend_if_lost
from ._protocol import (
    Command,
    Failure,
    ReplicaShortfall,
    Script,
    Send,
    SendReplicated,
    SendWithin,
    Sleep,
    Steps,
    clock_ms,
    pairs,
)
from ._registry import Entry, counted_held, entry_text, held_entry, parse_entry, task_field
from ._scripts import AcquireReply, CommitReceiptReply, ReleaseReply
from .exceptions import LeaseBackendError, LeaseBusy, LeaseConfigError

if TYPE_CHECKING:
    from ._engine import LeaseEngine
    from ._identity import Identity

__all__ = (
    "AcquireCall",
    "Busy",
    "RenewPlan",
    "Ticket",
    "acquire_group",
    "handed",
    "commit_receipt",
    "delete_receipt",
    "get_receipt",
    "leave_queues",
    "record_lost",
    "release",
    "release_entries",
    "renew",
    "try_acquire",
)

logger = logging.getLogger(__name__)

#: seconds between looks at the grant calls still in flight, in a lost reply's recovery
QUIET_POLL: Final = 0.005


@dataclass
class Busy:
    """A failed attempt: which resource blocked it and for how long at most."""

    resource: str
    wait: float  # seconds until the blocking holder runs out unless renewed
    refresh: float = math.inf  # seconds until the waiter's order goes stale (none: inf)


class AcquireCall(NamedTuple):
    """One acquire.lua call, and what its reply needs to be understood."""

    keys: list[str]
    args: list[Any]
    group: int
    wants: Sequence[Want]
    owner: str
    ttl: float
    home: bool
    task_id: str | None
    now: float  # monotonic time the call was made
    registry_s: float  # registry expiry the call sets (0: none)
    registry_arg: int  # its argument (engine.registry_expiry)
    ticket: Ticket | None  # a waiter's
    order_s: float  # a busy call leaves an order for a handoff valid this long (0: none)
    call_id: str  # this call's id, in the registry entries of its grants (see _registry)


class RenewPlan(NamedTuple):
    """The renew.lua calls of one renewal: ``(indices into held, keys, args)`` per group."""

    calls: list[tuple[list[int], list[str], list[Any]]]
    sent: float  # monotonic time the renewal was planned (no later than it reaches Redis)
    registry: dict[int, float]  # slot group -> registry expiry the call sets, in seconds


#: extra sleep after a holder's expiry before a waiter tries again
EXPIRY_SLACK: Final = 0.002


#: milliseconds a queued ticket outlives the wait its waiter was told: the waiter's next
#: attempt (which refreshes it) comes by then, unless it died or hangs
TICKET_SLACK_MS: Final = 3000


#: the ids of this process's grant calls: each call's registry entries bear its own, so that a
#: lost reply's recovery adopts only what its own call granted (see recover_grant)
_CALL_IDS: Final = itertools.count(secrets.randbelow(1 << 32))


def new_call_id() -> str:
    """A grant call's id, unique within this process (and so within its owner id)."""
    return format(next(_CALL_IDS), "x")


def _ticket_id() -> str:
    # decimal: a handed lease's registry entry names it where a token stands
    return str(10**14 + secrets.randbelow(9 * 10**14))


@dataclass
class Ticket:
    """One wait's place in the waiter queues (see lua/_waiters.lua), made once per wait.

    ``queued``: the resources whose queue it may be in now (the one an attempt was last
    blocked on: an attempt queues it only there, and leaves the others of its slot group).
    ``ordered_at``: for a wait that leaves orders (:func:`orders`), the monotonic time no
    later than the release that hands it the lease: the send of the last attempt that left
    an order (that attempt's order, or a later one, is the one handed on; an attempt whose
    reply was lost counts from the first order sent).
    """

    owner: str
    task_id: str | None = None
    #: the wait leaves orders (see :func:`orders`, asked of all it waits for)
    handoff: bool = False
    id: str = field(default_factory=_ticket_id)
    queued: set[str] = field(default_factory=set)
    ordered_at: float | None = None
    #: the ticket as the scripts get it: its id, and with a handoff the order too
    text: str = ""
    #: False once a lost reply's recovery ran in this wait: it may have given back a lease
    #: handed to it, so a handoff message is only a wake-up (the attempt that follows reads
    #: the handoff back, if the lease is still held: lua/acquire.lua)
    trusted: bool = True

    def __post_init__(self) -> None:
        self.text = self.text or self.id

    def accepts(self, token: str) -> bool:
        """True if a handoff message (of ``token``) ends the wait (see :attr:`trusted`)."""
        return self.trusted


def new_ticket(
    engine: LeaseEngine, wants: Sequence[Want], owner: str, ttl: float, task_id: str | None
) -> Ticket:
    """The ticket of a new wait for ``wants``; with its order when a release may hand it
    the lease (:func:`orders`)."""
    ticket = Ticket(owner, task_id, orders(engine, wants))
    if ticket.handoff:
        ticket.text = ticket_text(ticket.id, engine.ms(ttl), task_id, owner)
    return ticket


def ticket_text(ticket_id: object, ttl_ms: int, task_id: str | None, owner: str) -> str:
    """A ticket with its order, ``"<id> <ttl ms> <task> <owner>"`` (lua/_waiters.lua)."""
    return f"{ticket_id} {ttl_ms} {escape(task_id) if task_id else '-'} {owner}"


class GrantsInFlight(Exception):
    """A lost grant's recovery found other grant calls of this process still in flight."""


# --- acquire ------------------------------------------------------------------------------
def try_acquire(
    engine: LeaseEngine,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    task_id: str | None = None,
    ticket: Ticket | None = None,
) -> Steps[list[Held] | Busy]:
    """One all-or-nothing attempt at ``wants``; the grants come back in the order given.

    Resources are taken group by group in ascending group order (one script call per
    group; one call in all with a single slot group). If a later group is busy, or fails,
    the groups already granted are released again, so the caller never holds part of the
    set. With a ``ticket`` (a waiter's), a busy attempt queues it where it is blocked, and
    only there (see :func:`follow_ticket`); a grant takes it out of every queue.
    """
    if len(wants) == 1 and engine.resource_keys(wants[0].resource).group == 0:
        # the common case: one call, the home call inside it when due
        home = not engine.liveness_covers(ident.owner, ttl)
        outcome = yield from acquire_group(engine, 0, wants, ident, ttl, home, task_id, ticket)
    else:
        outcome = yield from _try_acquire(engine, wants, ident, ttl, task_id, ticket)
    if ticket is not None:
        yield from follow_ticket(engine, wants, ticket, outcome)
    return outcome


def follow_ticket(
    engine: LeaseEngine, wants: Sequence[Want], ticket: Ticket, outcome: list[Held] | Busy
) -> Steps[None]:
    """Record where ``ticket`` is queued after an attempt's ``outcome``.

    A grant took it out of every queue of its calls. A busy attempt queued it at the
    blocking resource and took it out of the others of that slot group; the groups before
    it were granted (and given back), so only the queues of later groups may still hold it
    from an earlier attempt: it leaves them, so a request never holds the head of a queue
    while it is blocked by another resource (that resource would stay free for nobody).
    """
    if not isinstance(outcome, Busy):
        ticket.queued = set()
        return
    group = engine.resource_keys(outcome.resource).group
    stale = {r for r in ticket.queued if engine.resource_keys(r).group > group}
    ticket.queued = {outcome.resource}
    if stale:
        yield from leave_queues(engine, [w for w in wants if w.resource in stale], ticket)


def _try_acquire(
    engine: LeaseEngine,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    task_id: str | None,
    ticket: Ticket | None,
) -> Steps[list[Held] | Busy]:
    by_group, fresh = acquire_plan(engine, wants, ident.owner, ttl)
    single = len(by_group) == 1 and len(next(iter(by_group.values()))) == 1
    if 0 not in by_group and not fresh:
        if single and not engine.wait_replicas:
            # the home call and the grant in one round trip (two nodes on a cluster)
            group = next(iter(by_group))
            return (
                yield from _acquire_with_home(engine, group, wants, ident, ttl, task_id, ticket)
            )
        outcome = yield from acquire_group(engine, 0, [], ident, ttl, True, task_id)
        if isinstance(outcome, Busy):
            return outcome
        fresh = True
    if single:
        group = next(iter(by_group))
        return (
            yield from acquire_group(engine, group, wants, ident, ttl, not fresh, task_id, ticket)
        )
    out: list[Held | None] = [None] * len(wants)
    taken: list[Held] = []
    for group in sorted(by_group):
        idx = sorted(by_group[group], key=lambda i: wants[i].resource)
        home = not fresh and group == 0
        try:
            outcome = yield from acquire_group(
                engine, group, [wants[i] for i in idx], ident, ttl, home, task_id, ticket
            )
        except LeaseBackendError:
            yield from release_quietly(engine, taken)  # the groups already granted
            raise
        if isinstance(outcome, Busy):
            if taken:
                yield from release(engine, taken, time.monotonic())
            return outcome
        for i, held in zip(idx, outcome, strict=True):
            out[i] = held
            taken.append(held)
    return [h for h in out if h is not None]


def waiting_time(outcome: list[Held] | Busy, now: float, deadline: float) -> float | None:
    """How long a waiter waits for a release after an attempt's ``outcome``; None: stop.

    It stops when granted or at ``deadline``, and else waits until a release wakes it, or
    until the blocking holder's expiry at the latest (each failed attempt says when that
    holder runs out), never past the deadline. The sync and asyncio waits both ask this.
    """
    if not isinstance(outcome, Busy) or now >= deadline:
        return None
    return min(deadline - now, outcome.wait + EXPIRY_SLACK, outcome.refresh)


def busy_error(outcome: Busy, holder_task: str | None, waited: float = 0.0) -> LeaseBusy:
    """The LeaseBusy of an attempt that stayed busy (``waited``: seconds spent waiting)."""
    return LeaseBusy(
        outcome.resource, retry_after=outcome.wait, waited=waited, holder_task=holder_task
    )


def release_quietly(engine: LeaseEngine, held: Sequence[Held]) -> Steps[None]:
    """Release ``held`` where a failure has nobody to tell: it runs out by its TTL (and
    the owner registry lets a cleanup free it sooner)."""
    try:
        yield from release(engine, held, time.monotonic())
    except LeaseBackendError as exc:
        logger.error("leases: could not release %d lease(s): %s", len(held), exc)


def _acquire_with_home(
    engine: LeaseEngine,
    group: int,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    task_id: str | None,
    ticket: Ticket | None = None,
) -> Steps[list[Held] | Busy]:
    """The owner's home call (group 0) and the grant in ``group``, sent together.

    If the home call is refused (restart grace) while the grant went through, the grant is
    given back, as :func:`try_acquire` would never have asked for it.
    """
    home = acquire_call(engine, 0, [], ident, ttl, True, task_id)
    call = acquire_call(engine, group, wants, ident, ttl, False, task_id, ticket)
    book = book_keys(engine, wants)
    BOOK.begin(call.owner, book)
    lost = False
    try:
        try:
            replies = yield Send(
                [Script("acquire", home.keys, home.args), Script("acquire", call.keys, call.args)]
            )
        except Failure as failure:
            if not failure.lost:
                raise engine.backend_error("acquire", failure) from failure.cause
            # read-back: the grant is adopted if it was made; the home call is idempotent
            BOOK.lost(call.owner, book)
            lost = True
            tokens = yield from _recover_grant_logged(engine, call, failure)
            adopted = (
                None
                if tokens is None
                else acquire_outcome(engine, adopted_call(call), [AcquireReply.GRANTED, *tokens])
            )
        else:
            registered = acquire_outcome(engine, home, replies[0])
            outcome = acquire_outcome(engine, call, replies[1])
            if isinstance(registered, Busy):
                if not isinstance(outcome, Busy):
                    yield from release(engine, outcome, time.monotonic())
                return registered
            return outcome
    finally:
        BOOK.end(call.owner, book, recovered=lost)
    # the reply was lost: the home call again, then (unless adopted) the grant again
    registered = yield from acquire_group(engine, 0, [], ident, ttl, True, task_id)
    if isinstance(registered, Busy):
        if adopted is not None and not isinstance(adopted, Busy):
            yield from release(engine, adopted, time.monotonic())
        return registered
    if adopted is not None:
        return adopted
    return (yield from acquire_group(engine, group, wants, ident, ttl, False, task_id, ticket))


def acquire_plan(
    engine: LeaseEngine, wants: Sequence[Want], owner: str, ttl: float
) -> tuple[dict[int, list[int]], bool]:
    """``(slot group -> indices into wants, True if the owner's home call can be skipped)``."""
    if len(wants) == 1:
        by_group = {engine.resource_keys(wants[0].resource).group: [0]}
    else:
        if len({w.resource for w in wants}) != len(wants):
            names = [w.resource for w in wants]
            dupes = sorted({n for n in names if names.count(n) > 1})
            msg = f"the same resource is asked for twice in one request: {dupes}"
            raise LeaseConfigError(msg)
        by_group = {}
        for i, w in enumerate(wants):
            by_group.setdefault(engine.resource_keys(w.resource).group, []).append(i)
    return by_group, engine.liveness_covers(owner, ttl)


def acquire_group(
    engine: LeaseEngine,
    group: int,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    home: bool,
    task_id: str | None = None,
    ticket: Ticket | None = None,
) -> Steps[list[Held] | Busy]:
    """One acquire.lua call for ``wants`` (all in slot group ``group``; none: the home call).

    A grant whose reply is lost (the connection cut or timed out after the request went
    out) is read back: t0 acquire.lua grants R to this owner; t1 the reply is lost; t2 a
    plain retry finds R held by this owner and reports it busy, and nobody renews or
    releases the grant of t0 until its TTL. So the call goes out once, and after a lost
    reply the grant of t0 is adopted if it is surely this call's, else given back and the
    call sent once more.
    """
    book = book_keys(engine, wants)
    for attempt in (1, 2):
        call = acquire_call(engine, group, wants, ident, ttl, home, task_id, ticket)
        BOOK.begin(call.owner, book)
        lost: bool | None = False  # None: the call's end was booked with its grant
        try:
            try:
                if engine.wait_replicas:
                    reply = yield from _grant_replicated(engine, call)
                else:  # the hot path: one request, no generator in between
                    (reply,) = yield Send([Script("acquire", call.keys, call.args)])
                if int(reply[0]) == AcquireReply.GRANTED:
                    # the tokens are booked and the call ends in one step (see granted())
                    leases = granted(engine, call, reply, book)
                    lost = None
                    return leases
                return acquire_outcome(engine, call, reply)
            except ReplicaShortfall as exc:  # the grant was given back already
                raise engine.backend_error("acquire", exc) from exc
            except Failure as failure:
                if not failure.lost:
                    raise engine.backend_error("acquire", failure) from failure.cause
                if wants:
                    BOOK.lost(call.owner, book)
                    lost = True
                    tokens = yield from _recover_grant_logged(engine, call, failure)
                    if tokens is not None:
                        return acquire_outcome(
                            engine, adopted_call(call), [AcquireReply.GRANTED, *tokens]
                        )
                # the home call alone is idempotent: it is simply sent again
                if attempt == 2:
                    raise engine.backend_error("acquire", failure) from failure.cause
        finally:
            if lost is not None:
                BOOK.end(call.owner, book, recovered=lost)
    raise AssertionError("unreachable")


def _grant_replicated(engine: LeaseEngine, call: AcquireCall) -> Steps[Any]:
    """acquire.lua for ``call`` then WAIT (min_replicas), on one connection; its reply.

    A grant that too few replicas confirm is given back before ReplicaShortfall is raised:
    a failover to one of them could hand the resource, and the same token, to another.
    """
    script = Script("acquire", call.keys, call.args)
    (reply,), (acked,) = yield SendReplicated([script])
    if int(reply[0]) == AcquireReply.GRANTED and int(acked) < engine.settings.min_replicas:
        granted = acquire_outcome(engine, call, reply)
        if not isinstance(granted, Busy):
            yield from release(engine, granted, time.monotonic())  # no replica can hand it on
        engine.check_replicated(acked, "grant")
    return reply


def book_keys(engine: LeaseEngine, wants: Sequence[Want]) -> list[str]:
    """The keys :data:`~celery_leases._lostreply.BOOK` knows ``wants``' grants by."""
    return [engine.resource_keys(w.resource).exclusive for w in wants]


def _recover_grant_logged(
    engine: LeaseEngine, call: AcquireCall, lost: Failure
) -> Steps[list[int] | None]:
    """:func:`recover_grant` for ``call``; a recovery that fails is logged, and raised.

    The call of a wait that leaves orders: the wait does not count as in flight while it
    recovers its own call (see :func:`ordering`), and takes no handoff on trust after.
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


def acquire_call(
    engine: LeaseEngine,
    group: int,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    home: bool,
    task_id: str | None = None,
    ticket: Ticket | None = None,
) -> AcquireCall:
    """The keys and arguments of one acquire.lua call (with a waiter's ``ticket``, or none)."""
    owner = ident.owner
    now = time.monotonic()
    call_id = new_call_id()
    registry_arg, registry_s = engine.registry_expiry(owner, group, ttl, now) if wants else (0, 0.0)
    order_s = 0.0
    if ticket is not None and ticket.handoff:
        # valid for half the lease's horizon: a handed lease counts from this call's send
        # (ordered_at), so it comes with half its horizon left at least; and within the
        # owner's liveness, which this call refreshes (home) or which covers that horizon
        order_s = engine.horizon(ttl) / 2
        if ticket.ordered_at is None:
            ticket.ordered_at = now
    keys = [engine.lifetime_key(group), engine.registry_key(owner, group)]
    args: list[Any] = [owner, engine.ms(ttl), engine.grace_ms]
    home = home and group == 0
    if home:
        keys += engine.home_keys(ident.node)
        args += ["1", engine.liveness, ident.node_key_part]
    else:
        args += ["0", "0", ""]
    args += [
        engine.token_memory_ms,
        registry_arg,
        task_field(task_id, call_id),
        ticket.text if ticket is not None else "",
        engine.waiter_prefix,
        trusted_receivers(engine),
        TICKET_SLACK_MS,
        engine.ms(order_s) if order_s else 0,
    ]
    for w in wants:
        rk = engine.resource_keys(w.resource)
        keys += (rk.exclusive, rk.shared, rk.counter, rk.waiters, rk.ticket_expiry, rk.handed)
        args += (w.mode, w.limit, w.resource)
    args += engine.history_args
    if engine.history and wants:
        keys.append(engine.keys.history(group))
        for w in wants:
            rk = engine.resource_keys(w.resource)
            keys += (rk.history, rk.record)
    return AcquireCall(
        keys,
        args,
        group,
        wants,
        owner,
        ttl,
        home,
        task_id,
        now,
        registry_s,
        registry_arg,
        ticket,
        order_s,
        call_id,
    )


def orders(engine: LeaseEngine, wants: Sequence[Want]) -> bool:
    """True if a wait for ``wants`` leaves orders, so a release can hand it the lease
    directly (lua/release.lua): one exclusive lease, where PUBLISH counts receivers exactly
    (not on a cluster) and no WAIT must confirm a grant (min_replicas)."""
    return (
        len(wants) == 1 and wants[0].mode == "x" and not engine.cluster and not engine.wait_replicas
    )


def acquire_outcome(
    engine: LeaseEngine, call: AcquireCall, reply: Sequence[Any]
) -> list[Held] | Busy:
    """What acquire.lua's ``reply`` to ``call`` means; records a home call and registry."""
    code = int(reply[0])
    if code == AcquireReply.GRACE:
        first = call.wants[0].resource if call.wants else "(owner registration)"
        return Busy(first, int(reply[1]) / 1000)
    if code == AcquireReply.BUSY:
        busy = Busy(call.wants[int(reply[1]) - 1].resource, int(reply[2]) / 1000)
        if call.order_s and call.ticket is not None:
            # the order is left, the handoff's registry entry recorded, the liveness
            # refreshed (home), as a grant would have
            call.ticket.ordered_at = call.now
            busy.refresh = call.order_s
            _booked(engine, call)
        return busy
    if code == AcquireReply.HANDED and call.ticket is not None:
        return handed(engine, call.wants, call.ttl, call.ticket, reply[1], call.call_id)
    # before the call counts as ended: a recovery must never take these for orphans
    return granted(engine, call, reply, None)


def handed(
    engine: LeaseEngine,
    wants: Sequence[Want],
    ttl: float,
    ticket: Ticket,
    token: Any,
    call_id: str = "",
) -> list[Held]:
    """The lease a release handed to ``ticket``'s wait for ``wants`` (one exclusive lease;
    see lua/release.lua), counted from ``ticket.ordered_at``, no later than its grant.

    ``call_id``: told by that wait's attempt (acquire.lua), which wrote the lease's registry
    entry with its token and the call's id in place of the ticket's; "": told by a message,
    the entry is still the ticket's (``"h <ticket> ..."``) until the first renewal."""
    since = ticket.ordered_at
    if since is None:  # never: a handoff needs an order, sent after ordered_at was set
        raise AssertionError("a lease was handed to a wait that left no order")
    w, owner = wants[0], ticket.owner
    token = int(token)
    held = Held(
        engine,
        owner,
        w.resource,
        "x",
        token,
        ttl,
        since,
        since,
        engine.horizon(ttl),
        task_id=ticket.task_id,
        ticket=0 if call_id else int(ticket.id),
        call=call_id,
    )
    BOOK.hold(owner, engine.resource_keys(w.resource).exclusive, token)
    ticket.queued = set()
    return [held]


@contextmanager
def ordering(engine: LeaseEngine, wants: Sequence[Want], ticket: Ticket) -> Iterator[None]:
    """A wait for ``wants`` that leaves orders counts as a grant call in flight (see
    :class:`~celery_leases._lostreply.GrantBook`) from its first attempt to its end: a lease
    handed to it is this owner's grant before the waiter hears of it, and a lost reply's
    recovery in another thread of the process must not take it for an orphan."""
    if not ticket.handoff:
        yield
        return
    book = book_keys(engine, wants)
    BOOK.begin(ticket.owner, book)
    try:
        yield
    finally:
        BOOK.end(ticket.owner, book)


def _booked(engine: LeaseEngine, call: AcquireCall) -> None:
    """Record what ``call`` refreshed: the owner's liveness (home), its registry's expiry."""
    if call.home:
        engine.registered[call.owner] = call.now
    if call.registry_s:
        engine.registry_until[(call.owner, call.group)] = call.now + call.registry_s


def granted(
    engine: LeaseEngine, call: AcquireCall, reply: Sequence[Any], book: Sequence[str] | None
) -> list[Held]:
    """The leases of a granting ``reply`` to ``call``; records the home call and registry.

    Their tokens go into the :data:`BOOK` as live leases; with ``book`` (the call's keys in
    it), in the same step as the call's end (:meth:`GrantBook.granted`).
    """
    owner, now, ttl, task_id = call.owner, call.now, call.ttl, call.task_id
    _booked(engine, call)
    horizon = engine.horizon(ttl)
    tokens = [int(token) for token in reply[1:]]
    out = [
        Held(
            engine,
            owner,
            w.resource,
            w.mode,
            token,
            ttl,
            now,
            now,
            horizon,
            task_id=task_id,
            call=call.call_id,
        )
        for w, token in zip(call.wants, tokens, strict=True)
    ]
    keys = book if book is not None else book_keys(engine, call.wants)
    BOOK.granted(owner, keys, tokens, ended=book is not None)
    return out


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


# --- renew --------------------------------------------------------------------------------
def renew(engine: LeaseEngine, held: Sequence[Held], owner: str, timeout: float) -> Steps[set[int]]:
    """Renew ``held`` (all of one owner) and refresh the owner's liveness.

    One script call per slot group, sent together in one round trip per node, under a
    deadline of ``timeout`` seconds (:class:`~celery_leases._protocol.SendWithin`: the
    heartbeat uses the time left before the first lease would count as lost). Idempotent
    after a lost reply: the driver never resends it (the caller hears of the failure), and
    the next renewal runs it again, token-checked; run twice it only extends the same
    leases twice.

    Returns:
        the indices (into ``held``) of leases Redis no longer has for us.
    """
    plan = renew_calls(engine, held, owner)
    scripts = [Script("renew", keys, args) for _, keys, args in plan.calls]
    try:
        replies, acked = yield SendWithin(scripts, timeout)
        for count in acked:  # one WAIT reply per node (none without min_replicas)
            engine.check_replicated(count, "renewal")
    except Failure as failure:
        raise engine.backend_error("renew", failure) from failure.cause
    except ReplicaShortfall as exc:
        raise engine.backend_error("renew", exc) from exc
    lost = renew_outcome(engine, plan, replies, owner)
    if lost and engine.history:
        yield from record_lost(engine, [held[i] for i in sorted(lost)])
    return lost


def record_lost(engine: LeaseEngine, lost: Sequence[Held]) -> Steps[None]:
    """Write a ``lost`` event for each of ``lost`` (a renewal found them gone) to the history.

    The rare path, so written here rather than in renew.lua; a failure is only logged (the
    lease is lost either way, and its holder is told).
    """
    hist, rhist, keep = engine.history_args
    calls: list[Command] = []
    for h in lost:
        text = entry_text(h.mode, h.token, h.task_id, h.resource)  # as granted, with its token
        fields = ("e", "lost", "x", text, "o", h.owner)
        key = engine.resource_keys(h.resource).history
        calls += [
            Command(("XADD", engine.keys.history(h.group), "MAXLEN", "~", hist, "*", *fields)),
            Command(("XADD", key, "MAXLEN", "~", rhist, "*", *fields)),
            Command(("PEXPIRE", key, keep)),
        ]
    try:
        yield Send(calls, once=True)
    except Failure as failure:
        logger.warning("leases: could not record %d lost lease(s): %s", len(lost), failure.cause)


def renew_calls(engine: LeaseEngine, held: Sequence[Held], owner: str) -> RenewPlan:
    """The renew.lua calls of :func:`renew`, one per slot group."""
    by_group: dict[int, list[int]] = {0: []}
    for i, h in enumerate(held):
        by_group.setdefault(h.group, []).append(i)
    longest = max([h.ttl for h in held] + [engine.settings.ttl])
    sent = time.monotonic()
    # A registry's expiry is never cut short here: another renewer of the same owner (the
    # asyncio heartbeat next to the thread, or the other way round) may hold longer leases
    # in it. t0 the thread renews a lease of ttl=3600 (registry: 4 h); t1 the asyncio
    # heartbeat renews one of ttl=30 (registry: 2 min); t2 the process dies; t3 the registry
    # runs out, and no cleanup finds the first lease for the next hour.
    registry: dict[int, float] = {}
    calls: list[tuple[list[int], list[str], list[Any]]] = []
    for group, idx in sorted(by_group.items()):
        left = engine.registry_until.get((owner, group), 0.0) - sent
        registry[group] = max(4 * longest, left)
        keys = [engine.registry_key(owner, group)]
        args: list[Any] = [owner, engine.ms(registry[group])]
        if group == 0:
            node = escaped_node_of_owner(owner)
            keys += engine.home_keys(unescape(node))
            args += ["1", engine.liveness, node]
        else:
            args += ["0", 0, ""]
        for i in idx:
            h = held[i]
            rk = engine.resource_keys(h.resource)
            keys.append(rk.exclusive if h.mode == "x" else rk.shared)
            args += [h.mode, h.token, engine.ms(h.ttl), held_entry(h).text]
        calls.append((idx, keys, args))
    return RenewPlan(calls, sent, registry)


def renew_outcome(
    engine: LeaseEngine, plan: RenewPlan, replies: Sequence[Any], owner: str
) -> set[int]:
    """The indices of the leases renew.lua's ``replies`` report lost; records the renewal."""
    lost: set[int] = set()
    for (idx, _, _), reply in zip(plan.calls, replies, strict=True):
        lost.update(idx[int(n) - 1] for n in reply)
    # this call refreshed the owner's liveness and its registries' expiry
    sent = plan.sent
    engine.registered[owner] = max(engine.registered.get(owner, sent), sent)
    for group, registry_s in plan.registry.items():
        engine.registry_until[(owner, group)] = sent + registry_s
    return lost


# --- release ------------------------------------------------------------------------------
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
    args += (*engine.history_args, event, by)
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


# --- the waiter queues --------------------------------------------------------------------
def leave_queues(engine: LeaseEngine, wants: Sequence[Want], ticket: Ticket) -> Steps[None]:
    """Take ``ticket`` out of the waiter queues of ``wants``, waking the next waiter where
    it was the head. Idempotent; one leave.lua call per slot group, in one round trip.

    Its orders go too, with the registry entries recorded for a handoff; a lease that a
    release handed to it meanwhile (lua/release.lua) is released again, as its wait is over.

    A failure is only logged: the ticket runs out on its own (see TICKET_SLACK_MS), and
    until then the waiters behind it are woken by their own timers.
    """
    by_group: dict[int, list[Want]] = {}
    for w in wants:
        by_group.setdefault(engine.resource_keys(w.resource).group, []).append(w)
    calls = []
    entries: list[list[Entry]] = []
    for group, group_wants in sorted(by_group.items()):
        keys: list[str] = []
        args: list[Any] = [ticket.text, engine.waiter_prefix, trusted_receivers(engine)]
        entries.append([])
        for w in group_wants:
            rk = engine.resource_keys(w.resource)
            keys += (rk.waiters, rk.ticket_expiry, rk.handed)
            entry = Entry("x", 0, ticket.task_id, w.resource, int(ticket.id))
            entries[-1].append(entry)
            ordered = ticket.ordered_at is not None and w.mode == "x"
            args += (w.mode, entry.text if ordered else "")
        keys.append(engine.registry_key(ticket.owner, group))
        calls.append(Script("leave", keys, args))
    ticket.queued -= {w.resource for w in wants}
    if not calls:
        return
    try:
        replies = yield Send(calls, once=False)  # idempotent: the client may send it again
        for group, group_entries, reply in zip(sorted(by_group), entries, replies, strict=True):
            handed_over = [
                e._replace(token=int(token))
                for e, token in zip(group_entries, reply, strict=True)
                if int(token)
            ]
            if handed_over:
                yield from release_entries(engine, ticket.owner, group, handed_over)
    except (Failure, LeaseBackendError) as failure:
        logger.warning(
            "leases: a waiter could not leave the queue of %s (%s); its ticket runs out "
            "on its own (the wait it was last told, plus %d ms), and a lease handed to it "
            "meanwhile by its TTL",
            ", ".join(repr(w.resource) for w in wants),
            failure.cause if isinstance(failure, Failure) else failure,
            TICKET_SLACK_MS,
        )


# --- once receipts ------------------------------------------------------------------------
def get_receipt(engine: LeaseEngine, name: str) -> Steps[str | None]:
    """The stored receipt (JSON text) of ``once(name)``, or None."""
    (value,) = yield from engine.send(
        "read a receipt", [Command(("GET", engine.keys.receipt(name)))]
    )
    return None if value is None else str(value)


def put_delivery_done(
    engine: LeaseEngine, task_id: str, retries: int, state: str, ttl: float
) -> Steps[None]:
    """Record that a delivery of a task ended in ``state`` (kept ``ttl`` seconds).

    The redelivery guard's completion record: a copy of the same delivery that arrives later
    (its ack was lost) is dropped. Idempotent: a resend writes the same value again.
    """
    key = engine.keys.delivery_done(task_id, retries)
    command = Command(("SET", key, state, "PX", engine.ms(ttl)))
    yield from engine.send("record a delivery's end", [command])


def get_delivery_done(engine: LeaseEngine, task_id: str, retries: int) -> Steps[str | None]:
    """The state in which a delivery of a task ended, or None (no completion record)."""
    key = engine.keys.delivery_done(task_id, retries)
    (value,) = yield from engine.send("read a delivery's end", [Command(("GET", key))])
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def commit_receipt(
    engine: LeaseEngine, name: str, held: Held, receipt: str, ttl: float | None
) -> Steps[bool]:
    """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
    keys = [engine.resource_keys(held.resource).exclusive, engine.keys.receipt(name)]
    args: list[Any] = [
        holder_value(held.token, held.owner),
        receipt,
        0 if ttl is None else engine.ms(ttl),
    ]
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
