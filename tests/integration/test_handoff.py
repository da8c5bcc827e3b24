"""The handoff: a release grants an exclusive lease to the waiter at the head of the queue.

A wait for one exclusive lease queues its ticket with its order (ttl, task, owner: see
lua/_waiters.lua); a release grants the lease to that waiter in the same script and publishes
the token on the waiter's channel, so the woken waiter needs no round trip of its own
(issue 14, part (b)). These tests drive the scripts on a real Redis: a "parked" ticket is a
wait between two of its attempts, its channel listened to by a plain subscriber.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_leases import Leases, _census, _grants
from celery_leases._grants import TICKET_SLACK_MS, Busy, Ticket, leave_queues, new_ticket
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._lostreply import BOOK
from tests.support.holders import hold_by_hand
from tests.support.polling import SCHEDULING, wait_until

MakeLeases = Callable[..., Leases]
WAITER = Identity("waiter", "inc", 2)


def poll(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, step=0.005)


@pytest.fixture
def parked(leases: Leases, leases_redis: redis.Redis) -> Iterator[Callable[..., Any]]:
    """Make a ticket of ``WAITER`` queued with its order behind a holder of "r", its channel
    listened to: ``(ticket, pubsub)``."""
    opened: list[redis.client.PubSub] = []

    def park(ttl: float = 10.0) -> tuple[Ticket, redis.client.PubSub]:
        engine = leases.store.engine
        ticket = new_ticket(engine, [Want("r")], WAITER.owner, ttl, None)
        assert ticket.handoff
        pubsub = leases_redis.pubsub()
        opened.append(pubsub)
        pubsub.subscribe(leases.store.keys.waiter_channel(ticket.id))
        assert poll(lambda: pubsub.get_message(timeout=0.1), SCHEDULING, "the subscription")
        busy = leases.store.run(
            _grants.try_acquire(engine, [Want("r")], WAITER, ttl, ticket=ticket)
        )
        assert isinstance(busy, Busy)
        assert busy.refresh < math.inf  # it left an order
        return ticket, pubsub

    yield park
    for pubsub in opened:
        pubsub.close()


def subscribers(client: redis.Redis, channel: str) -> int:
    """The clients subscribed to ``channel`` (by name: patterns are not counted)."""
    return int(dict(client.pubsub_numsub(channel)).get(channel, 0))


def message(pubsub: redis.client.PubSub) -> str:
    got = poll(
        lambda: pubsub.get_message(timeout=0.1), SCHEDULING, "a message on the waiter's channel"
    )
    return str(got["data"])


def value(client: redis.Redis, leases: Leases, resource: str = "r") -> str | None:
    return client.get(leases.store.keys.exclusive(resource))  # type: ignore[return-value]


def queue_keys(client: redis.Redis, leases: Leases, resource: str = "r") -> int:
    keys = leases.store.keys
    return int(
        client.exists(keys.waiters(resource), keys.ticket_expiry(resource), keys.handed(resource))
    )


def registry(client: redis.Redis, leases: Leases, who: Identity) -> set[str]:
    return set(client.smembers(leases.store.keys.registry(who.owner, 0))) - {"~"}


class Waiter(threading.Thread):
    def __init__(self, leases: Leases, wait: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.leases, self.wait = leases, wait
        self.token = 0
        self.expires_in = 0.0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with self.leases.hold("r", wait=self.wait, ttl=10) as lease:
                self.token, self.expires_in = lease.token, lease.expires_in
                self.done.wait(30)
        except BaseException as exc:
            self.error = exc


def counting_acquire_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _grants.acquire_call

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_grants, "acquire_call", counted)
    return calls


# --- through the public API -----------------------------------------------------------------
def test_a_release_hands_the_lease_over_and_the_waiter_asks_nothing(
    leases: Leases, leases_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    calls = counting_acquire_calls(monkeypatch)
    (held,) = hold_by_hand(leases, "r")
    waiter = Waiter(leases)
    waiter.start()
    queued = leases.store.keys.waiters("r")
    poll(lambda: leases_redis.zcard(queued) == 1, SCHEDULING, "the waiter queued")
    asked = len(calls)
    leases.store.release([held])
    poll(lambda: waiter.token, SCHEDULING, "the waiter's grant")
    assert len(calls) == asked  # no attempt of its own after the release: the lease came to it
    assert waiter.token > held.token
    owner = leases.identity().owner
    assert value(leases_redis, leases) == f"{waiter.token} {owner}"
    assert 0 < waiter.expires_in <= 10
    # recorded in the owner's registry (by the waiter, when it queued), so a cleanup finds it
    assert any(
        str(e).startswith("h ") for e in leases_redis.smembers(leases.store.keys.registry(owner, 0))
    )
    waiter.done.set()
    waiter.join(SCHEDULING)
    assert not waiter.is_alive()
    assert waiter.error is None
    assert value(leases_redis, leases) is None
    assert not any(
        str(e).startswith("h ") for e in leases_redis.smembers(leases.store.keys.registry(owner, 0))
    )
    assert queue_keys(leases_redis, leases) == 0  # nothing left behind


@pytest.mark.asyncio
async def test_an_asyncio_waiter_is_handed_the_lease(
    make_leases: MakeLeases, monkeypatch: pytest.MonkeyPatch
):
    leases = make_leases()
    client = redis.Redis.from_url(leases.settings.url, decode_responses=True)
    calls = counting_acquire_calls(monkeypatch)
    (held,) = hold_by_hand(leases, "r")
    got: list[int] = []

    async def waiter() -> None:
        async with leases.ahold("r", ttl=10, wait=30) as lease:
            got.append(lease.token)

    task = asyncio.create_task(waiter())
    deadline = time.monotonic() + SCHEDULING
    while client.zcard(leases.store.keys.waiters("r")) == 0:
        assert time.monotonic() < deadline, "the waiter never queued"
        await asyncio.sleep(0.005)
    asked = len(calls)
    leases.store.release([held])
    await asyncio.wait_for(task, SCHEDULING)
    assert len(calls) == asked
    assert got
    assert got[0] > held.token
    assert queue_keys(client, leases) == 0
    client.close()


# --- the scripts, step by step ----------------------------------------------------------------
def test_the_handed_lease_is_the_waiters_and_a_cleanup_of_it_finds_it(
    leases: Leases, leases_redis: redis.Redis, parked
):
    (held,) = hold_by_hand(leases, "r")
    ticket, pubsub = parked()
    keys = leases.store.keys
    # the ticket carries the order: "x<id> <ttl ms> <task> <owner>" (lua/_waiters.lua)
    member = f"x{ticket.id} 10000 - {WAITER.owner}"
    assert leases_redis.zrange(keys.waiters("r"), 0, -1) == [member]
    assert leases.store.release([held]) == [True]
    token = int(message(pubsub).removeprefix("h"))
    assert token > held.token
    # moved from the queue to the handed tickets, scored by the token, as long as it lived
    assert leases_redis.zrange(keys.waiters("r"), 0, -1) == []
    assert leases_redis.zscore(keys.handed("r"), member) == token
    assert leases_redis.zscore(keys.ticket_expiry("r"), member) is not None
    assert value(leases_redis, leases) == f"{token} {WAITER.owner}"
    assert leases_redis.pttl(leases.store.keys.exclusive("r")) > 9000
    assert registry(leases_redis, leases, WAITER) == {f"h {ticket.id} - r"}
    # `celery leases ls` lists it, with its token
    rows = [r for r in _census.take_census(leases.store).held if r.resource == "r"]
    assert [(r.owner, r.mode, r.token) for r in rows] == [(WAITER.owner, "x", token)]
    # the waiter died holding it: the cleanup of its owner frees it, by that entry
    report = leases.store.cleanup_owner(WAITER.owner, dead=True)
    assert report.released == [(WAITER.owner, "r")]
    assert value(leases_redis, leases) is None
    assert registry(leases_redis, leases, WAITER) == set()


def test_an_attempt_under_way_learns_of_the_handoff(
    leases: Leases, leases_redis: redis.Redis, parked
):
    (held,) = hold_by_hand(leases, "r")
    ticket, pubsub = parked()
    leases.store.release([held])
    token = int(message(pubsub).removeprefix("h"))
    # the wait's next attempt was sent before it read the message: it is told the grant
    engine = leases.store.engine
    outcome = leases.store.run(
        _grants.try_acquire(engine, [Want("r")], WAITER, 10.0, ticket=ticket)
    )
    assert isinstance(outcome, list)
    (lease,) = outcome
    # told by its own attempt, its entry names its token and that call from now on
    # (issue 26, part 1): no cleanup has to find it from the handed tickets
    assert (lease.token, lease.ticket, lease.confirmed_at) == (token, 0, ticket.ordered_at)
    assert lease.call
    assert registry(leases_redis, leases, WAITER) == {f"x {token} -%c{lease.call} r"}
    assert leases.store.release(outcome) == [True]
    assert value(leases_redis, leases) is None
    assert registry(leases_redis, leases, WAITER) == set()
    assert queue_keys(leases_redis, leases) == 0


def test_a_wait_that_ends_as_it_is_handed_the_lease_gives_it_back(
    leases: Leases, leases_redis: redis.Redis, parked
):
    (held,) = hold_by_hand(leases, "r")
    ticket, pubsub = parked()
    leases.store.release([held])
    assert message(pubsub).startswith("h")
    ticket.queued = {"r"}
    leases.store.run(leave_queues(leases.store.engine, [Want("r")], ticket))
    assert value(leases_redis, leases) is None
    assert registry(leases_redis, leases, WAITER) == set()
    # a second leave (a retry) finds nothing more to do
    leases.store.run(leave_queues(leases.store.engine, [Want("r")], ticket))
    assert value(leases_redis, leases) is None


def test_a_waiter_nobody_listens_for_is_not_handed_the_lease(
    leases: Leases, leases_redis: redis.Redis, parked
):
    (held,) = hold_by_hand(leases, "r")
    ticket, pubsub = parked()
    # another client's pattern subscription, as a Celery worker on a Redis broker holds for
    # its fanout queues: it listens for nobody's channel here, and must not count as a listener
    other = leases_redis.pubsub()
    try:
        other.psubscribe(f"{leases.settings.key_prefix}:elsewhere:*")
        assert poll(lambda: other.get_message(timeout=0.1), SCHEDULING, "the pattern")
        pubsub.close()
        # this waiter's channel, not the server's count of patterns (PUBSUB NUMPAT: every
        # pattern of every client, in any database, for as long as they live)
        channel = leases.store.keys.waiter_channel(ticket.id)
        poll(lambda: subscribers(leases_redis, channel) == 0, SCHEDULING, "the subscriber gone")
        leases.store.release([held])
    finally:
        other.close()
    assert value(leases_redis, leases) is None  # free, not handed to a dead waiter
    assert leases_redis.zcard(leases.store.keys.waiters("r")) == 0  # and its ticket dropped


def test_a_stale_order_is_woken_not_handed(leases: Leases, leases_redis: redis.Redis, parked):
    (held,) = hold_by_hand(leases, "r")
    _ticket, pubsub = parked()
    keys = leases.store.keys
    now_ms = int(leases_redis.time()[0]) * 1000 + 1000
    member = str(leases_redis.zrange(keys.waiters("r"), 0, 0)[0])
    # its expiry less the slack has passed: the waiter may not be counting on the order
    leases_redis.zadd(keys.ticket_expiry("r"), {member: now_ms + TICKET_SLACK_MS - 2000})
    leases.store.release([held])
    assert message(pubsub) == str(held.token)  # woken, to ask for itself
    assert value(leases_redis, leases) is None


def test_no_handoff_in_the_restart_grace(leases: Leases, leases_redis: redis.Redis, parked):
    (held,) = hold_by_hand(leases, "r")
    _, pubsub = parked()
    key = leases.store.engine.lifetime_key(0)
    record = str(leases_redis.get(key))
    until_ms = int(leases_redis.time()[0]) * 1000 + 60_000
    leases_redis.set(key, f"{until_ms} {record.split(' ', 1)[1]}")
    leases.store.release([held])
    assert message(pubsub) == str(held.token)
    assert value(leases_redis, leases) is None


# --- which waits leave orders -------------------------------------------------------------------
def test_only_a_wait_for_one_exclusive_lease_off_a_cluster_leaves_an_order(leases: Leases):
    engine = leases.store.engine
    assert _grants.orders(engine, [Want("a")])
    assert not _grants.orders(engine, [Want("a", "s")])
    assert not _grants.orders(engine, [Want("a"), Want("b")])
    engine.cluster = True  # PUBLISH's count of receivers is not exact there
    try:
        assert not _grants.orders(engine, [Want("a")])
    finally:
        engine.cluster = False


def test_a_wait_that_leaves_orders_counts_as_a_grant_in_flight(leases: Leases):
    # a lost reply's recovery in another thread of the process must not take a lease handed
    # to the wait, not yet heard of, for an orphan: it waits until the wait is over
    engine = leases.store.engine
    ticket = new_ticket(engine, [Want("r")], WAITER.owner, 10.0, None)
    book = [engine.resource_keys("r").exclusive]
    assert BOOK.quiet(WAITER.owner, book) is not None
    with _grants.ordering(engine, [Want("r")], ticket):
        assert BOOK.quiet(WAITER.owner, book) is None
    assert BOOK.quiet(WAITER.owner, book) is not None
