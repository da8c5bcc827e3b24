"""Waiting, written once: for a grant, for a unique claim, for a resource to be free.

A wait is a core operation (see ``_protocol``) that also yields :class:`Listen`: the
driver's ``run_wait`` keeps one subscription for the whole wait and carries each Listen out
on it. Timeline of a wait for a grant: t0 the first attempt is busy; t1 a ticket, and the
subscription (a Listen of no time) to the release channels and the ticket's own channel;
t2 an attempt with the ticket, which queues it where it is blocked (lua/_waiters.lua); t3 a
listen until a release wakes it, hands it the lease (lua/release.lua), or the blocking
holder runs out; then t2 again, until granted or out of time. Subscribing before t2 means no
release after that attempt goes unheard.

A caller may go away mid-wait (an interrupt, a cancelled coroutine). The driver then stops
the wait at its next request that it has not sent yet (sync) or at its next Listen (asyncio,
whose attempts run to their end in a task of their own), and runs :attr:`Wait.give_back`
with what came back, if anything: the lease granted to nobody, the waiter queues left. No
redis, no asyncio.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from . import _claims, _grants, _inspect
from ._claims import ClaimHolder, claim_waiting_time
from ._grants import EXPIRY_SLACK, Busy, Ticket, busy_error, waiting_time
from ._lease import Held, Want
from ._protocol import Failure, Heard, Listen, Steps

if TYPE_CHECKING:
    from ._engine import LeaseEngine
    from ._identity import Identity

__all__ = ("Wait", "acquire", "stopped", "unique_take", "until_free")

T = TypeVar("T")

#: what each wait's listen failure says it tried to do (a LeaseBackendError's message)
FOR_RELEASE: Final = "wait for a release"
FOR_CLAIM: Final = "wait for a unique claim"


@dataclass(slots=True)
class Wait(Generic[T]):
    """One wait, for a driver's ``run_wait``.

    Attributes:
        steps: the wait itself: requests (Listen among them) in, its outcome out.
        give_back: what is left to do when the caller went away: sent the outcome that came
            back to nobody (None: the wait was stopped before it had one).
    """

    steps: Steps[T]
    give_back: Callable[[T | None], Steps[None]]


def stopped(wait: Wait[Any], error: BaseException) -> bool:
    """True if ``error``, out of a driver's run of ``wait``, stopped it mid-way (an
    interrupt, a cancelled caller), not the wait's own error (after which it left the
    queues itself): then it is closed, and its :attr:`~Wait.give_back` is due."""
    if inspect.getgeneratorstate(wait.steps) == inspect.GEN_CLOSED and isinstance(error, Exception):
        return False
    wait.steps.close()
    return True


def _nothing(outcome: object) -> Steps[None]:
    """A give-back with nothing to give back."""
    return
    yield  # a generator


def listen(
    engine: LeaseEngine,
    what: str,
    channels: Sequence[str],
    timeout: float,
    handed_on: str | None = None,
) -> Steps[str | None]:
    """One :class:`Listen`; the token handed over, or None. A failed subscriber connection
    is a LeaseBackendError saying ``what`` was tried."""
    try:
        heard: Heard = yield Listen(channels, timeout, handed_on)
    except Failure as failure:
        raise engine.backend_error(what, failure.cause) from failure.cause
    return heard.token


# --- a grant ------------------------------------------------------------------------------
def acquire(
    engine: LeaseEngine,
    wants: Sequence[Want],
    ident: Identity,
    ttl: float,
    wait: float | None,
    task_id: str | None,
) -> Wait[list[Held]]:
    """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

    A waiter takes a ticket, subscribes to its own channel (and the release channels of
    every resource it wants), then tries again. A busy attempt queues the ticket at the
    resource that blocks it (lua/_waiters.lua): a release wakes the head of that queue
    alone, at once (no polling), or hands it the lease when it is one exclusive lease
    (lua/release.lua); the blocking holder's expiry wakes it at the latest, since each
    failed attempt says when that holder runs out. Within a slot group, waiters are served
    first come, first served. While it waits it holds none of the resources; when it stops
    waiting without a grant (out of time, failed, interrupted) it leaves the queues.

    The steps raise LeaseBusy (still busy when the wait ran out; ``.resource`` names the
    first busy one) or LeaseBackendError (Redis failed).
    """
    tickets: list[Ticket] = []  # the wait's ticket, once it has one

    def steps() -> Steps[list[Held]]:
        start = time.monotonic()
        outcome = yield from _grants.try_acquire(engine, wants, ident, ttl, task_id)
        if not isinstance(outcome, Busy):
            return outcome
        if wait is not None and wait <= 0:
            raise busy_error(outcome, (yield from _inspect.holder_task(engine, outcome.resource)))
        deadline = math.inf if wait is None else start + wait
        # a place in the waiter queues: woken alone, on its own channel, when its turn comes
        ticket = _grants.new_ticket(engine, wants, ident.owner, ttl, task_id)
        tickets.append(ticket)
        mine = engine.keys.waiter_channel(ticket.id)
        channels = [*sorted({engine.resource_keys(w.resource).channel for w in wants}), mine]
        try:
            with _grants.ordering(engine, wants, ticket):
                yield from listen(engine, FOR_RELEASE, channels, 0.0)  # subscribed first
                while True:
                    outcome = yield from _grants.try_acquire(
                        engine, wants, ident, ttl, task_id, ticket
                    )
                    pause = waiting_time(outcome, time.monotonic(), deadline)
                    if pause is None:
                        break
                    token = yield from listen(engine, FOR_RELEASE, channels, pause, mine)
                    if token is not None and ticket.accepts(token):
                        outcome = _grants.handed(engine, wants, ttl, ticket, token)
                        break
        except Exception:
            # failed: it may be queued anywhere it waited; leave, and wake the next waiter
            ticket.queued = {w.resource for w in wants}
            yield from _grants.leave_queues(engine, wants, ticket)
            raise
        if ticket.queued:  # out of time: leave where it was last blocked
            yield from _grants.leave_queues(engine, wants, ticket)
        if isinstance(outcome, Busy):
            waited = time.monotonic() - start
            holder = yield from _inspect.holder_task(engine, outcome.resource)
            raise busy_error(outcome, holder, waited)
        return outcome

    def give_back(outcome: list[Held] | None) -> Steps[None]:
        if outcome:  # granted to a caller that went away
            yield from _grants.release_quietly(engine, outcome)
        elif tickets:  # stopped mid-wait: it may be queued anywhere it waited
            ticket = tickets[0]
            ticket.queued = {w.resource for w in wants}
            yield from _grants.leave_queues(engine, wants, ticket)

    return Wait(steps(), give_back)


# --- a unique claim -----------------------------------------------------------------------
def unique_take(
    engine: LeaseEngine,
    key: str,
    task_id: str,
    ident: Identity,
    ttl: float,
    wait: float,
    handed: tuple[str, int, str] | None = None,
) -> Wait[Held | ClaimHolder]:
    """Take over ``key``'s claim for ``task_id``, waiting where waiting can help.

    While the claim is held by a run of this same task id in another process (a
    redelivered message; the first run may be dead and its lease about to be freed) or
    Redis is in its restart grace, wait up to ``wait`` seconds, woken by the claim's
    release (no polling) or the holder's expiry. A claim of another task id is answered at
    once: waiting cannot make it ours. No ticket: a claim has no waiter queue, so a caller
    that went away leaves nothing (only the sync driver takes claims, and it is never
    handed an outcome once its caller is gone). ``handed``: see
    :func:`_claims.unique_handover`.
    """

    def steps() -> Steps[Held | ClaimHolder]:
        start = time.monotonic()
        outcome = yield from _claims.unique_handover(engine, key, task_id, ident, ttl, handed)
        if isinstance(outcome, Held) or not outcome.waits_for(task_id) or wait <= 0:
            return outcome
        deadline = start + wait
        channels = [engine.resource_keys(engine.keys.unique_resource(key)).channel]
        yield from listen(engine, FOR_CLAIM, channels, 0.0)  # subscribed first
        while True:
            outcome = yield from _claims.unique_handover(engine, key, task_id, ident, ttl, handed)
            pause = claim_waiting_time(outcome, task_id, time.monotonic(), deadline)
            if pause is None:
                return outcome
            yield from listen(engine, FOR_CLAIM, channels, pause)

    return Wait(steps(), _nothing)


# --- a resource free ----------------------------------------------------------------------
def until_free(engine: LeaseEngine, resource: str, timeout: float | None) -> Wait[bool]:
    """Wait until ``resource`` has no holder (True), or ``timeout`` seconds pass (False;
    None: no limit). It takes no lease and no place in the waiter queue.

    Subscribed to the resource's release channel first, it reads the holders, and listens
    until a release or the soonest holder's expiry, then reads them again: no polling. (A
    release that passes the lease on to a queued waiter publishes nothing on that channel:
    the resource stays held, and the expiry of the holder last read wakes it at the latest.)
    """

    def steps() -> Steps[bool]:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        channels = [engine.resource_keys(resource).channel]
        yield from listen(engine, FOR_RELEASE, channels, 0.0)  # subscribed first
        while True:
            holders = yield from _inspect.holders(engine, resource)
            now = time.monotonic()
            if not holders or now >= deadline:
                return not holders
            soonest = min(h.expires_in for h in holders)
            yield from listen(
                engine, FOR_RELEASE, channels, min(deadline - now, soonest + EXPIRY_SLACK)
            )

    return Wait(steps(), _nothing)
