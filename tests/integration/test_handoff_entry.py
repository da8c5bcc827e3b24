"""A handoff's registry entry never frees a lease it does not stand for (issue 26, part 1).

A waiter W that queues with a handoff order writes ``"h <ticket> - R"`` into its registry. The
entry can outlive W's interest in R: a stalled server times out W's attempt and then its leave
(one fault), or W's order refresh and then W's attempt that learns of the handoff both lose
their replies (two faults). W then idles until its liveness runs out, and a reconcile that
listed W reaches it only after W was granted R again. The entry used to stand for "whatever
exclusive lease of R the owner holds": the reconcile freed W's fresh lease, and another owner
was granted R while W counted it held.

Everything is driven step by step on the real test Redis: the faults are thrown into the
operations by their driver (the request runs and its reply is lost, or it never runs), the
reconcile is held between its listing of the expired owners and its cleanup of W, and W's
liveness is made to have run out by setting its score in the owners index.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_leases import Leases, _cleanup, _grants
from celery_leases._aio.driver import AsyncLeaseStore
from celery_leases._grants import Busy, Ticket, new_ticket
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._one_attempt import failure_of
from celery_leases._protocol import Op, Script, Send, Steps, adrive, drive
from celery_leases.exceptions import LeaseBackendError
from tests.support.holders import hold_by_hand
from tests.support.polling import SCHEDULING, wait_until

W = Identity("waiter-w", "inc", 7)
X = Identity("other-x", "inc", 8)
TTL = 10.0

#: what a fault does to a request: "lose" (it runs, its reply is lost), "stall" (it times out
#: before it runs), or None (it goes through)
Fault = Callable[[Op], str | None]


def script_name(op: Op) -> str | None:
    if isinstance(op, Send) and len(op.calls) == 1 and isinstance(op.calls[0], Script):
        return op.calls[0].name
    return None


def is_grant(op: Op) -> bool:
    """An acquire.lua call for a resource (not the owner's home call alone)."""
    return isinstance(op, Send) and any(
        isinstance(c, Script) and c.name == "acquire" and len(c.keys) > 5 for c in op.calls
    )


def lose_first_grant() -> Fault:
    done: list[bool] = []

    def fault(op: Op) -> str | None:
        if is_grant(op) and not done:
            done.append(True)
            return "lose"
        return None

    return fault


def stall_after_first_grant() -> Fault:
    """The first grant runs and its reply is lost; the server stalls for everything after."""
    done: list[bool] = []

    def fault(op: Op) -> str | None:
        if done:
            return "stall"
        if is_grant(op):
            done.append(True)
            return "lose"
        return None

    return fault


def stall_all(op: Op) -> str | None:
    return "stall"


class Driver:
    """Carries out core operations on the store, sync or with the asyncio driver, with a
    ``fault``; ``between(op)`` runs after a request went through (before its reply is read)."""

    def __init__(self, leases: Leases, kind: str) -> None:
        self.store, self.kind = leases.store, kind

    def run(
        self,
        steps: Steps[Any],
        fault: Fault | None = None,
        between: Callable[[Op, Any], None] | None = None,
    ) -> Any:
        def before(op: Op) -> str | None:
            how = fault(op) if fault is not None else None
            if how == "stall":
                raise RedisTimeoutError("the server stalls (test)")
            return how

        def after(op: Op, reply: Any, how: str | None) -> Any:
            if how == "lose":
                raise RedisTimeoutError("the reply was lost (test)")
            if between is not None:
                between(op, reply)
            return reply

        if self.kind == "sync":

            def execute(op: Op) -> Any:
                how = before(op)
                return after(op, self.store._execute(op), how)

            return drive(steps, execute, RedisError, failure_of)

        async def main() -> Any:
            astore = AsyncLeaseStore(self.store.settings, engine=self.store.engine)
            state = astore._state()

            async def aexecute(op: Op) -> Any:
                how = before(op)
                return after(op, await astore._execute(state, op), how)

            try:
                return await adrive(steps, aexecute, RedisError, failure_of)
            finally:
                await astore.aclose()

        return asyncio.run(main())


@pytest.fixture(params=["sync", "asyncio"])
def driver(request: pytest.FixtureRequest, leases: Leases) -> Driver:
    return Driver(leases, request.param)


@pytest.fixture
def listener(leases_redis: redis.Redis) -> Iterator[Callable[[Ticket], redis.client.PubSub]]:
    """Listen on a ticket's channel (so that a release hands the lease to it)."""
    opened: list[redis.client.PubSub] = []

    def listen(ticket: Ticket) -> redis.client.PubSub:
        pubsub = leases_redis.pubsub()
        opened.append(pubsub)
        pubsub.subscribe(ticket.channel_name)  # type: ignore[attr-defined]
        assert wait_until(
            lambda: pubsub.get_message(timeout=0.1), SCHEDULING, "the subscription", step=0.005
        )
        return pubsub

    yield listen
    for pubsub in opened:
        pubsub.close()


def handed_message(pubsub: redis.client.PubSub) -> int:
    got = wait_until(
        lambda: pubsub.get_message(timeout=0.1), SCHEDULING, "the handoff message", step=0.005
    )
    text = str(got["data"])
    assert text.startswith("h")
    return int(text[1:])


def entries(leases_redis: redis.Redis, leases: Leases, who: Identity) -> set[str]:
    return set(leases_redis.smembers(leases.store.keys.registry(who.owner, 0))) - {"~"}


def value(leases_redis: redis.Redis, leases: Leases) -> str | None:
    return leases_redis.get(leases.store.keys.exclusive("r"))  # type: ignore[return-value]


def ticket_of(leases: Leases) -> Ticket:
    ticket = new_ticket(leases.store.engine, [Want("r")], W.owner, TTL, None)
    assert ticket.handoff
    ticket.channel_name = leases.store.keys.waiter_channel(ticket.id)  # type: ignore[attr-defined]
    return ticket


def attempt(leases: Leases, ticket: Ticket) -> Steps[list[Held] | Busy]:
    return _grants.try_acquire(leases.store.engine, [Want("r")], W, TTL, ticket=ticket)


def reconcile_meets_a_fresh_grant(
    leases: Leases, leases_redis: redis.Redis, driver: Driver
) -> list[Held]:
    """W's liveness has run out; a reconcile lists W, then W is granted R again, then the
    reconcile cleans W up. W's fresh lease must survive, and another owner be refused."""
    store = leases.store
    assert value(leases_redis, leases) is None  # R is free
    now_ms = int(leases_redis.time()[0]) * 1000  # type: ignore[index]
    leases_redis.zadd(store.keys.owners, {W.owner: now_ms - 1000}, xx=True)
    fresh: list[list[Held]] = []

    def w_takes_r(op: Op, reply: Any) -> None:
        if script_name(op) == "expired_owners" and not fresh:
            assert W.owner in [str(o) for o in reply[0][::2]]
            got = store.try_acquire([Want("r")], W, TTL)
            assert isinstance(got, list)
            fresh.append(got)

    driver.run(_cleanup.reconcile(store.engine), between=w_takes_r)
    (held,) = fresh[0]
    assert value(leases_redis, leases) == f"{held.token} {W.owner}", (
        "the reconcile freed a lease granted after it looked at the owner"
    )
    assert isinstance(store.try_acquire([Want("r")], X, TTL), Busy), "two exclusive holders"
    return fresh[0]


def test_one_fault_a_stall_leaves_the_entry_and_no_reconcile_frees_a_fresh_lease(
    leases: Leases, leases_redis: redis.Redis, driver: Driver
) -> None:
    store = leases.store
    holder = hold_by_hand(leases, "r")
    ticket = ticket_of(leases)
    # W's attempt runs (W queued with its order, the entry written), then the server stalls:
    # the attempt's reply is lost and its read-back times out
    with pytest.raises(LeaseBackendError):
        driver.run(attempt(leases, ticket), stall_after_first_grant())
    # and its leave times out too (only logged)
    driver.run(_grants.leave_queues(store.engine, [Want("r")], ticket), stall_all)
    assert entries(leases_redis, leases, W) == {f"h {ticket.id} - r"}
    # H releases R: nobody listens for W's ticket any more, so R is not handed to it
    assert store.release(holder) == [True]
    fresh = reconcile_meets_a_fresh_grant(leases, leases_redis, driver)
    store.release(fresh)


def test_two_lost_replies_leave_no_entry_and_no_reconcile_frees_a_fresh_lease(
    leases: Leases,
    leases_redis: redis.Redis,
    driver: Driver,
    listener: Callable[[Ticket], redis.client.PubSub],
) -> None:
    store = leases.store
    holder = hold_by_hand(leases, "r")
    ticket = ticket_of(leases)
    pubsub = listener(ticket)
    # W's order refresh loses its reply (it ran: W is queued with its order)
    busy = driver.run(attempt(leases, ticket), lose_first_grant())
    assert isinstance(busy, Busy)
    assert busy.refresh < math.inf
    # H's release hands R to W's ticket
    assert store.release(holder) == [True]
    token = handed_message(pubsub)
    # W's attempt right after learns of the handoff, and loses its reply too
    outcome = driver.run(attempt(leases, ticket), lose_first_grant())
    assert isinstance(outcome, list)
    (held,) = outcome
    assert held.token == token
    assert value(leases_redis, leases) == f"{token} {W.owner}"
    assert store.release(outcome) == [True]
    assert entries(leases_redis, leases, W) == set(), "an entry outlived the lease"
    fresh = reconcile_meets_a_fresh_grant(leases, leases_redis, driver)
    store.release(fresh)


def test_a_cleanup_spares_a_handed_lease_granted_after_it_looked_at_the_owner(
    leases: Leases,
    leases_redis: redis.Redis,
    listener: Callable[[Ticket], redis.client.PubSub],
) -> None:
    # the reaper's spare_newer path: t0 the pass reads the clock; t1 R is handed to W (a pid
    # reused by a new pool process); t2 the pass cleans W: the handed lease is spared
    store = leases.store
    holder = hold_by_hand(leases, "r")
    ticket = ticket_of(leases)
    pubsub = listener(ticket)
    assert isinstance(store.run(attempt(leases, ticket)), Busy)
    before_us, offsets = store.clocks_us()
    assert store.release(holder) == [True]
    token = handed_message(pubsub)
    report = store.cleanup_owner(
        W.owner, dead=True, granted_before_us=before_us - 1, clock_offsets_us=offsets
    )
    assert report.released == []
    assert value(leases_redis, leases) == f"{token} {W.owner}"
    assert entries(leases_redis, leases, W) == {f"h {ticket.id} - r"}  # kept
    assert isinstance(store.try_acquire([Want("r")], X, TTL), Busy)
    # without a bound (W died), the handed lease is what its entry stands for: freed
    report = store.cleanup_owner(W.owner, dead=True)
    assert report.released == [(W.owner, "r")]
    assert value(leases_redis, leases) is None


def test_a_renewal_writes_a_handed_leases_entry_with_its_token(
    leases: Leases,
    leases_redis: redis.Redis,
    listener: Callable[[Ticket], redis.client.PubSub],
) -> None:
    store = leases.store
    holder = hold_by_hand(leases, "r")
    ticket = ticket_of(leases)
    pubsub = listener(ticket)
    assert isinstance(store.run(attempt(leases, ticket)), Busy)
    assert store.release(holder) == [True]
    token = handed_message(pubsub)
    held = _grants.handed(store.engine, [Want("r")], TTL, ticket, token)
    assert entries(leases_redis, leases, W) == {f"h {ticket.id} - r"}
    assert store.renew(held, W.owner, TTL) == set()
    assert entries(leases_redis, leases, W) == {f"x {token} - r"}
    assert store.release(held) == [True]
    assert entries(leases_redis, leases, W) == set()
