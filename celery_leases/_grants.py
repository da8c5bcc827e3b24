"""Grants, written once: acquire over slot groups, the home call, the waiter's ticket.

Each operation is a generator of protocol requests (see ``_protocol``): it plans its script
calls, reads their replies and chooses the next step, and either driver carries it out
(its ``run``). The give-back of a partial grant over several
slot groups is written here only; a lost grant's read-back is ``_readback``'s, releases are
``_releases``', renewals ``_renew``'s, once's receipts and delivery records ``_receipts``'.
No I/O.
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

from ._lease import Held, Want
from ._lostreply import BOOK
from ._protocol import (
    Failure,
    ReplicaShortfall,
    Script,
    Send,
    SendReplicated,
    Steps,
)
from ._readback import adopted_call, book_keys, recover_call
from ._receipts import (
    commit_receipt,
    delete_receipt,
    get_delivery_done,
    get_receipt,
    put_delivery_done,
)
from ._registry import TICKET_SLACK_MS, Entry, task_field, ticket_text
from ._releases import release, release_entries, release_quietly, trusted_receivers
from ._renew import renew
from ._scripts import AcquireReply
from .exceptions import LeaseBackendError, LeaseBusy, LeaseConfigError

if TYPE_CHECKING:
    from ._engine import LeaseEngine
    from ._identity import Identity

__all__ = (
    "AcquireCall",
    "Busy",
    "Ticket",
    "acquire_group",
    "handed",
    "leave_queues",
    "try_acquire",
    # the drivers' names for these until they call the modules that define them
    "commit_receipt",
    "delete_receipt",
    "get_delivery_done",
    "get_receipt",
    "put_delivery_done",
    "release",
    "release_quietly",
    "renew",
)

logger = logging.getLogger(__name__)


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


#: extra sleep after a holder's expiry before a waiter tries again
EXPIRY_SLACK: Final = 0.002


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
            tokens = yield from recover_call(engine, call, failure)
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
                    tokens = yield from recover_call(engine, call, failure)
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
    args += engine.grant_history
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
