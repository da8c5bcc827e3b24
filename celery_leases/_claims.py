"""Unique claims, written once: claim, handover, requeue, unclaim, inspect.

A task declared with ``unique=`` has at most one copy queued or running per rendered key.
The claim is the exclusive lease of ``Keyspace.unique_resource(key)``: the producer takes it
with the queue TTL before publishing (queued: ``"<token> %queued/<task id>"``, in no owner's
registry); the worker that starts the task takes it over (running: an ordinary lease of that
process, renewed and cleaned up like every other); the task's finalizer releases it with
release.lua (token-checked), and so does any cleanup of a dead owner. All the keys of one
claim are in the claim resource's slot group.

Each operation is a generator of protocol requests (see ``_protocol``), carried out by a
driver (its ``run``). A lost reply's recovery is decided with ``_lostreply``. No I/O. The
beat claims are in ``_beat_claims``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from ._engine import LeaseEngine
from ._grants import EXPIRY_SLACK, Busy, acquire_call, acquire_group, acquire_outcome
from ._inspect import OPS_BATCH, registry_task
from ._keys import UNIQUE_PREFIX, escape, holder_parts, holder_value, unescape
from ._lease import Held, Want
from ._lostreply import BOOK, requeue_recovered, resend_if_lost
from ._protocol import Command, Failure, Script, Send, Steps
from ._readback import GrantsInFlight, log_unrecovered, recover_grant
from ._registry import QUEUED_OWNER, held_entry
from ._scripts import (
    AcquireReply,
    UniqueClaimReply,
    UniqueHandoverReply,
    UniqueRequeueReply,
    UniqueUnclaimReply,
)
from .exceptions import LeaseBackendError

if TYPE_CHECKING:
    from ._identity import Identity

__all__ = (
    "ClaimHolder",
    "ClaimMode",
    "Claimed",
    "claim_waiting_time",
    "queued_claims",
    "unique_claim",
    "unique_confirm",
    "unique_handover",
    "unique_holder",
    "unique_requeue",
    "unique_unclaim",
)

#: reads of a running claim holder's task id, which a release at the wrong moment loses
_HOLDER_READS: Final = 3

_Outcome = TypeVar("_Outcome")


# --- what a claim call returns ------------------------------------------------------------
@dataclass(frozen=True)
class ClaimMode:
    """What a producer's claim does besides refusing while a copy is queued or running
    (docs/unique.md "Modes", unique_claim.lua's ARGV): ``kind`` (ARGV[7]: "" refuse or
    throttle, "r" replace, "k" keep_last, "d" debounce), ``window`` (throttle, seconds),
    ``forget`` (seconds a replaced task id or a run's newest arguments are kept),
    ``message`` (keep_last, debounce: the send as a parked message), ``quiet`` and
    ``max_wait`` (debounce: its window and longest wait, seconds), ``cancel`` (on_duplicate=
    "cancel": seconds until a running copy's claim is force-released; 0: no cancel) and
    ``reason`` (cancel: the revocation's reason)."""

    kind: str = ""
    window: float = 0.0
    forget: float = 0.0
    message: str = ""
    quiet: float = 0.0
    max_wait: float = 0.0
    cancel: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Claimed:
    """A unique claim queued for a task (``again``: it already was, by an earlier publish)."""

    key: str
    task_id: str
    token: int
    again: bool = False
    #: unique_mode="replace": the task id whose queued claim this one took (it never runs)
    replaced: str | None = None
    #: unique_mode="keep_last": not sent; the task id of the run that takes its arguments
    follows: str | None = None
    #: on_duplicate="cancel": the running copy asked to stop ("<token> <owner>"), and the
    #: seconds until its claim is force-released; this send is parked as its follow-up
    cancels: str | None = None
    deadline: float = 0.0


@dataclass(frozen=True)
class ClaimHolder:
    """Who holds a unique claim (that the caller could not get).

    Attributes:
        key: the rendered unique key.
        state: ``"queued"`` (published, not started), ``"running"`` (a worker took it over),
            ``"grace"`` (Redis is in its restart grace; nobody may be granted anything),
            ``"throttled"`` (``unique_mode="throttle"``: the window of ``task_id``'s send
            runs) or ``"replaced"`` (a later send replaced the starting task's claim).
        task_id: the holding task's id; None when it could not be read (it changed hands
            while it was read, or the key was written by something else).
        token: the claim's fencing token.
        owner: for ``"running"``, the owner id of the worker process that runs it.
        expires_in: seconds until the claim runs out unless renewed; None: it never does.
    """

    key: str
    state: Literal["queued", "running", "grace", "throttled", "replaced"]
    task_id: str | None
    token: int
    owner: str | None
    expires_in: float | None

    @property
    def holder_unread(self) -> bool:
        """Running, but the holder's task id could not be read (see ``task_id``)."""
        return self.state == "running" and self.task_id is None

    def waits_for(self, task_id: str) -> bool:
        """True if a taker for ``task_id`` should wait (not give up): the claim is held by
        a run of that same task elsewhere, or Redis is in its restart grace."""
        return self.state == "grace" or (self.state == "running" and self.task_id == task_id)


# --- claim (the producer) -----------------------------------------------------------------
def unique_claim(
    engine: LeaseEngine, key: str, task_id: str, ttl: float, mode: ClaimMode | None = None
) -> Steps[Claimed | ClaimHolder]:
    """Claim ``key`` for ``task_id``, about to be published, for ``ttl`` seconds.

    The producer claims with the short ``unique_confirm_window`` (the claim is pending) and
    confirms it with :func:`unique_confirm` once the message is published.

    Returns:
        :class:`Claimed` (``again`` when it was already queued for this task id), or the
        :class:`ClaimHolder` that has it.

    ``mode`` changes what the claim does: see :class:`ClaimMode`.

    Raises:
        LeaseBackendError: with ``maybe_claimed`` set when the call's reply was lost and its
            resend failed: the claim may have been made.
    """
    return (yield from _holder_read(lambda: _claim_attempt(engine, key, task_id, ttl, mode)))


def _claim_attempt(
    engine: LeaseEngine, key: str, task_id: str, ttl: float, mode: ClaimMode | None
) -> Steps[Claimed | ClaimHolder]:
    resource = engine.keys.unique_resource(key)
    Want(resource)  # a name without a UTF-8 form is a LeaseConfigError, not a redis one
    call = _unique_claim_call(engine, resource, task_id, ttl, None, mode)
    try:
        # one attempt first: a failure after it may have run is told apart below
        (reply,) = yield Send([call])
        lost = False
    except Failure as failure:
        if not failure.lost:
            raise engine.backend_error("claim a unique key", failure) from failure.cause
        lost = True
    if lost:
        try:
            # idempotent: sent again, it finds the claim the lost call made, queued for this
            # task id; that claim is this call's own (not an earlier publish's), so a failed
            # publish gives it back
            (reply,) = yield Send([call], once=False)
        except Failure as failure:
            # the lost call may have claimed: the caller must know (nothing to give back
            # by token; by task id once Redis answers), and the claim is pending meanwhile
            error = engine.backend_error("claim a unique key", failure)
            error.maybe_claimed, error.task_id, error.key = True, task_id, key
            raise error from failure.cause
    code = int(reply[0])
    if code in (UniqueClaimReply.CLAIMED, UniqueClaimReply.CLAIMED_AGAIN):
        again = code == UniqueClaimReply.CLAIMED_AGAIN and not lost
        replaced = unescape(str(reply[2])) if len(reply) > 2 else None
        return Claimed(key, task_id, int(reply[1]), again=again, replaced=replaced)
    if code == UniqueClaimReply.FOLLOWS:
        return Claimed(key, task_id, 0, follows=unescape(str(reply[1])))
    if code == UniqueClaimReply.CANCELS:
        holder, left = str(reply[1]), int(reply[2]) / 1000
        return Claimed(key, task_id, 0, follows=task_id, cancels=holder, deadline=left)
    if code == UniqueClaimReply.THROTTLED:
        pttl = int(reply[2])
        last = unescape(str(reply[1]))
        return ClaimHolder(key, "throttled", last, 0, None, None if pttl < 0 else pttl / 1000)
    return (yield from _claim_holder(engine, key, resource, str(reply[1]), int(reply[2])))


def unique_confirm(
    engine: LeaseEngine,
    key: str,
    task_id: str,
    token: int,
    ttl: float,
    mode: ClaimMode | None = None,
) -> Steps[bool]:
    """Confirm the pending claim of ``key`` for ``task_id`` (``token``): its message is
    published; it now lives ``ttl`` seconds (the queue TTL).

    Returns False, writing nothing, when the claim is no longer queued for that task and
    token: a worker took it over (a fast worker may start the task before the confirm
    lands), it was released (the task ran and ended) or it ran out. A confirm never brings
    a claim back.
    """
    resource = engine.keys.unique_resource(key)
    call = _unique_claim_call(engine, resource, task_id, ttl, token, mode)
    try:
        # idempotent (token-checked, only ever raises a TTL)
        (reply,), _ = yield from resend_if_lost([call])
    except Failure as failure:
        raise engine.backend_error("confirm a unique claim", failure) from failure.cause
    return int(reply[0]) == UniqueClaimReply.CLAIMED


def _unique_claim_call(
    engine: LeaseEngine,
    resource: str,
    task_id: str,
    ttl: float,
    token: int | None = None,
    mode: ClaimMode | None = None,
) -> Script:
    """unique_claim.lua for ``task_id``'s claim of ``resource``: a pending claim of ``ttl``,
    or with the claim's ``token``, its confirm (the claim now lives ``ttl``)."""
    rk = engine.resource_keys(resource)
    keys = [rk.exclusive, rk.counter, engine.keys.unique_queued(rk.group)]
    keys += [engine.keys.unique_window(resource), engine.keys.unique_replaced(resource)]
    keys += engine.keys.park_keys(resource)[:3]
    keys += [engine.keys.park_due(rk.group), engine.keys.unique_newest(resource)]
    keys.append(rk.revocation)
    args: list[Any] = [escape(task_id), engine.ms(ttl), engine.token_memory_ms, resource]
    args.append("" if token is None else str(token))
    mode = mode or ClaimMode()
    args += [engine.ms(mode.window) if mode.window else "0", mode.kind, engine.ms(mode.forget)]
    args += [mode.message, f"x 0 {resource}", engine.ms(mode.quiet), engine.ms(mode.max_wait)]
    args += [engine.ms(mode.cancel) if mode.cancel else "0", mode.reason]
    return Script("unique_claim", keys, args)


def _holder_read(attempt: Callable[[], Steps[_Outcome]]) -> Steps[_Outcome]:
    """``attempt`` (a claim or a handover), made again while it names a running holder
    whose task id could not be read.

    The holder's task id is read from its registry after the script: a release in
    between leaves no entry. The next attempt finds the claim free, or reads its new
    holder; a holder unreadable ``_HOLDER_READS`` times is a key written by something
    else.
    """
    outcome = yield from attempt()
    for _ in range(_HOLDER_READS - 1):
        if not (isinstance(outcome, ClaimHolder) and outcome.holder_unread):
            break
        outcome = yield from attempt()
    return outcome


# --- handover (the worker that starts the task) ---------------------------------------------
def unique_handover(
    engine: LeaseEngine,
    key: str,
    task_id: str,
    ident: Identity,
    ttl: float,
    handed: tuple[str, int, str] | None = None,
) -> Steps[Held | ClaimHolder]:
    """One attempt to take over ``key``'s claim for ``task_id`` as a lease of ``ident``.

    It succeeds when the claim is queued for ``task_id`` or when there is none. (A holder
    that changed hands while it was read is looked at again: see :func:`_holder_read`.)
    ``handed`` (``unique_mode="keep_last"``): the message's park tombstone, how long it is
    kept (ms) and ``"1"`` for a message the broker redelivered: a follow-up handed on to
    ``task_id`` is taken over and consumed; a copy of one consumed already is refused
    (``"replaced"``), unless redelivered (a run that started and died: it runs again).
    """
    return (
        yield from _holder_read(lambda: _handover_attempt(engine, key, task_id, ident, ttl, handed))
    )


def _handover_attempt(
    engine: LeaseEngine,
    key: str,
    task_id: str,
    ident: Identity,
    ttl: float,
    handed: tuple[str, int, str] | None,
) -> Steps[Held | ClaimHolder]:
    resource = engine.keys.unique_resource(key)
    want = Want(resource)
    rk = engine.resource_keys(resource)
    group, owner = rk.group, ident.owner
    if not engine.liveness_covers(owner, ttl):
        # register the owner and refresh its liveness first (as try_acquire does for a
        # lease outside the home group): a lease in the registry of an unregistered owner
        # is invisible to the start-up cleanup of its node and to the reconcile, and one
        # whose owner's liveness runs out before the lease's horizon is freed by a
        # reconcile while its holder still counts it held
        home = yield from acquire_group(engine, 0, [], ident, ttl, True, task_id)
        if isinstance(home, Busy):
            return ClaimHolder(key, "grace", None, 0, None, home.wait)
    # the grant's record (its time, its registry expiry) as the acquire path makes it
    grant = acquire_call(engine, group, [want], ident, ttl, False, task_id)
    now = grant.now
    keys = [
        engine.keys.lifetime(group),
        engine.registry_key(owner, group),
        rk.exclusive,
        rk.counter,
        engine.keys.unique_queued(group),
        engine.keys.unique_replaced(resource),
        *engine.keys.park_keys(resource),
    ]
    args: list[Any] = [
        owner,
        engine.ms(ttl),
        engine.grace_ms,
        engine.token_memory_ms,
        grant.registry_arg,
        escape(task_id),
        resource,
        grant.call_id,
        *(handed or ("", 0, "")),
    ]
    call = Script("unique_handover", keys, args)
    book = [rk.exclusive]
    BOOK.begin(owner, book)
    lost = False
    try:
        try:
            (reply,) = yield Send([call])
        except Failure as failure:
            if not failure.lost:
                raise engine.backend_error("take over a unique claim", failure) from failure.cause
            BOOK.lost(owner, book)
            lost = True
            until = now + engine.horizon(ttl) / 2  # as adopt_until for a grant
            reply = yield from _recover_handover(
                engine, call, owner, group, resource, task_id, until, grant.call_id
            )
        code = int(reply[0])
        if code == UniqueHandoverReply.GRACE:
            return ClaimHolder(key, "grace", None, 0, None, int(reply[1]) / 1000)
        if code == UniqueHandoverReply.REPLACED:
            return ClaimHolder(key, "replaced", task_id, 0, None, None)
        if code == UniqueHandoverReply.BUSY:
            return (yield from _claim_holder(engine, key, resource, str(reply[1]), int(reply[2])))
        # records the registry expiry, and the token in the BOOK before the call ends
        outcome = acquire_outcome(engine, grant, [AcquireReply.GRANTED, int(reply[1])])
    finally:
        BOOK.end(owner, book, recovered=lost)
    assert isinstance(outcome, list)
    return outcome[0]


def _recover_handover(
    engine: LeaseEngine,
    call: Script,
    owner: str,
    group: int,
    resource: str,
    task_id: str,
    adopt_until: float,
    call_id: str,
) -> Steps[Any]:
    """After a lost handover reply: read-back, as for a grant (see ``recover_grant``).

    Sent again, the script would find the claim taken by this owner and report it held
    by a running task (this one): the lease nobody renews blocks the key until its TTL.
    So the own grant is adopted, or given back and the call sent once more.
    """
    try:
        tokens = yield from recover_grant(
            engine, owner, group, [(resource, "x")], task_id, adopt_until, call_id
        )
    except (LeaseBackendError, Failure, GrantsInFlight) as failed:
        cause = failed.cause if isinstance(failed, Failure) else failed
        log_unrecovered([resource], ConnectionError("lost reply"), cause)
        if isinstance(failed, LeaseBackendError):
            raise
        raise engine.backend_error("take over a unique claim", failed) from cause
    if tokens is not None:
        return [UniqueHandoverReply.TAKEN, tokens[0]]
    try:
        (reply,) = yield Send([call])
    except Failure as failure:
        if not failure.lost:
            raise engine.backend_error("take over a unique claim", failure) from failure.cause
        log_unrecovered([resource], ConnectionError("lost reply"), ConnectionError("lost again"))
        twice = ConnectionError("the reply to a unique handover was lost twice")
        raise engine.backend_error("take over a unique claim", twice) from twice
    return reply


def claim_waiting_time(
    outcome: Held | ClaimHolder, task_id: str, now: float, deadline: float
) -> float | None:
    """How long a taker of ``task_id``'s claim waits after ``outcome``; None: stop.

    It stops when it has the claim, when waiting cannot make it its own (the claim is held
    by another task), or at ``deadline``; else it waits for the claim's release, or the
    holder's expiry at the latest.
    """
    if isinstance(outcome, Held) or not outcome.waits_for(task_id) or now >= deadline:
        return None
    pause = deadline - now
    if outcome.expires_in is not None:
        pause = min(pause, outcome.expires_in + EXPIRY_SLACK)
    return pause


# --- requeue and unclaim --------------------------------------------------------------------
def unique_requeue(engine: LeaseEngine, held: Held, ttl: float) -> Steps[bool]:
    """Put a running claim (``held``) back in the queued state for its task, for ``ttl``.

    Returns False, changing nothing, when ``held`` no longer has the claim.
    """
    rk = engine.resource_keys(held.resource)
    keys = [
        rk.exclusive,
        engine.registry_key(held.owner, rk.group),
        engine.keys.unique_queued(rk.group),
    ]
    args: list[Any] = [
        holder_value(held.token, held.owner),
        held_entry(held).text,  # as written, with the grant call's id
        escape(held.task_id or ""),
        engine.ms(ttl),
        held.resource,
    ]
    call = Script("unique_requeue", keys, args)
    try:
        try:
            (reply,) = yield Send([call])
            return int(reply) == UniqueRequeueReply.QUEUED
        except Failure as failure:
            if not failure.lost:
                raise
        # read-back: sent again, it would find the claim queued and say "not ours"
        (value,) = yield Send([Command(("GET", rk.exclusive))], once=False)
        queued = QUEUED_OWNER + escape(held.task_id or "")
        done = requeue_recovered(value, held.token, held.owner, queued)
        if done is not None:
            return done
        (reply,) = yield Send([call], once=False)
        return int(reply) == UniqueRequeueReply.QUEUED
    except Failure as failure:
        raise engine.backend_error("queue a unique claim again", failure) from failure.cause


def unique_unclaim(
    engine: LeaseEngine,
    key: str,
    task_id: str,
    token: int | None = None,
    replaced: str | None = None,
) -> Steps[bool]:
    """Release ``key``'s claim if it is still queued for ``task_id`` (and ``token``).

    Returns True if it was released; a claim a worker took over, or one of another task,
    is left alone. Its throttle window goes with it; ``replaced``, the task id whose claim
    it replaced, may run again.
    """
    resource = engine.keys.unique_resource(key)
    Want(resource)
    rk = engine.resource_keys(resource)
    keys = [rk.exclusive, engine.keys.unique_queued(rk.group)]
    keys += [engine.keys.unique_window(resource), engine.keys.unique_replaced(resource)]
    args: list[Any] = [
        escape(task_id),
        "" if token is None else str(token),
        resource,
        rk.channel,
        "" if replaced is None else escape(replaced),
    ]
    try:
        # idempotent (token-checked): sent again, it gives back what is still there
        (reply,), _ = yield from resend_if_lost([Script("unique_unclaim", keys, args)])
    except Failure as failure:
        raise engine.backend_error("release a queued unique claim", failure) from failure.cause
    return int(reply) == UniqueUnclaimReply.RELEASED


# --- inspect --------------------------------------------------------------------------------
def unique_holder(engine: LeaseEngine, key: str) -> Steps[ClaimHolder | None]:
    """Who holds ``key``'s claim now, or None when it is free."""
    resource = engine.keys.unique_resource(key)
    Want(resource)
    xkey = engine.resource_keys(resource).exclusive
    value, pttl = yield from engine.send(
        "inspect a unique claim", [Command(("GET", xkey)), Command(("PTTL", xkey))]
    )
    if value is None:
        return None
    return (yield from _claim_holder(engine, key, resource, str(value), int(pttl)))


def queued_claims(engine: LeaseEngine) -> Steps[list[ClaimHolder]]:
    """Every unique claim still queued (its task not started yet), by key.

    Read from each slot group's index of queued claims, never from the keyspace; a claim
    that ran out or was taken over since it was listed is left out.
    """
    what = "list queued unique claims"
    indexes = [
        Command(("ZRANGE", engine.keys.unique_queued(group), 0, -1))
        for group in range(engine.settings.slot_groups)
    ]
    listed = yield from engine.send(what, indexes)
    resources = sorted({str(m) for reply in listed for m in reply})
    out: list[ClaimHolder] = []
    for start in range(0, len(resources), OPS_BATCH):
        chunk = resources[start : start + OPS_BATCH]
        reads: list[Command] = []
        for resource in chunk:
            xkey = engine.resource_keys(resource).exclusive
            reads += (Command(("GET", xkey)), Command(("PTTL", xkey)))
        replies = yield from engine.send(what, reads)
        for i, resource in enumerate(chunk):
            value, pttl = replies[2 * i], int(replies[2 * i + 1])
            if value is None or not resource.startswith(UNIQUE_PREFIX):
                continue
            token, who = holder_parts(value)
            if not who.startswith(QUEUED_OWNER) or not token.isdigit():
                continue
            out.append(
                ClaimHolder(
                    resource.removeprefix(UNIQUE_PREFIX),
                    "queued",
                    unescape(who.removeprefix(QUEUED_OWNER)),
                    int(token),
                    None,
                    None if pttl < 0 else pttl / 1000,
                )
            )
    return out


def _claim_holder(
    engine: LeaseEngine, key: str, resource: str, value: str, pttl: int
) -> Steps[ClaimHolder]:
    """A claim key's value, read: queued (the task id is in it) or running (read the
    task id from the holder's registry entry)."""
    text, who = holder_parts(value)
    token = int(text) if text.isdigit() else 0
    expires_in = None if pttl < 0 else pttl / 1000
    if who.startswith(QUEUED_OWNER):
        task_id = unescape(who.removeprefix(QUEUED_OWNER))
        return ClaimHolder(key, "queued", task_id, token, None, expires_in)
    task = yield from registry_task(engine, who, resource, token)
    return ClaimHolder(key, "running", task, token, who, expires_in)
