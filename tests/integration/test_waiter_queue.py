"""The waiter queue: one waiter woken per release, first come first served (issue 14).

A waiter holds a ticket in the queue of the resource that blocks it (lua/_waiters.lua). A
release wakes the queue's live head alone, on the waiter's own channel; a waiter that stops
waiting leaves the queue and wakes the next; a dead waiter's ticket runs out. These tests use
real Redis: the queue's order and the commands a release costs are read from the server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_leases import LeaseBusy, Leases, Shared
from celery_leases._grants import TICKET_SLACK_MS
from tests.support.holders import hold_by_hand
from tests.support.polling import SCHEDULING, wait_until

MakeLeases = Callable[..., Leases]


def poll(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, step=0.005)


def queue(client: redis.Redis, leases: Leases, resource: str) -> list[str]:
    """The tickets queued for ``resource``, first first."""
    return [str(m) for m in client.zrange(leases.store.keys.waiters(resource), 0, -1)]


class Waiter(threading.Thread):
    """``leases.hold(resource, wait=...)`` in a thread; records when it was granted, in order."""

    def __init__(
        self,
        leases: Leases,
        resource: Any,
        wait: float | None,
        order: list[int] | None = None,
        index: int = 0,
        gate: threading.Event | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.leases, self.resource, self.wait = leases, resource, wait
        self.order, self.index, self.gate = order, index, gate
        self.granted_at: float | None = None
        self.token = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.leases.hold(self.resource, wait=self.wait, ttl=10) as got:
                self.granted_at = time.monotonic()
                self.token = (got if isinstance(got, list) else [got])[0].token
                if self.order is not None:
                    self.order.append(self.index)
                if self.gate is not None:
                    self.gate.wait(60)  # held until the test has counted
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "the waiter never returned"


def start_in_order(leases: Leases, client: redis.Redis, resource: str, n: int) -> list[Waiter]:
    """``n`` waiters, each started once the one before it is seen in the queue."""
    order: list[int] = []
    waiters = []
    for i in range(n):
        w = Waiter(leases, resource, wait=120, order=order, index=i)
        w.start()
        poll(
            lambda i=i: len(queue(client, leases, resource)) == i + 1,
            SCHEDULING,
            f"waiter {i} queued",
        )
        waiters.append(w)
    return waiters


def test_waiters_are_granted_in_the_order_they_queued(leases: Leases, leases_redis):
    held = hold_by_hand(leases, "r")
    waiters = start_in_order(leases, leases_redis, "r", 6)
    assert leases.store.release(held) == [True]
    for w in waiters:
        w.finish(SCHEDULING)
        assert w.error is None
    assert waiters[0].order == [0, 1, 2, 3, 4, 5]
    assert queue(leases_redis, leases, "r") == []
    keys = leases.store.keys
    assert leases_redis.exists(keys.waiters("r"), keys.ticket_expiry("r")) == 0


def test_a_call_without_a_ticket_does_not_barge_past_a_waiter(leases: Leases, leases_redis):
    held = hold_by_hand(leases, "r", ttl=3)
    (waiter,) = start_in_order(leases, leases_redis, "r", 1)
    # freed behind the waiter's back: no release, so nobody is woken
    leases_redis.delete(leases.store.keys.exclusive("r"))
    with pytest.raises(LeaseBusy), leases.hold("r", wait=0):
        pass
    leases.store.release(held)  # not held any more: wakes nobody, the waiter's timer does
    waiter.finish(SCHEDULING)
    assert waiter.error is None


def test_the_queued_ticket_has_an_expiry_and_its_keys_expire(leases: Leases, leases_redis):
    held = hold_by_hand(leases, "r", ttl=5)
    (waiter,) = start_in_order(leases, leases_redis, "r", 1)
    keys = leases.store.keys
    (ticket,) = queue(leases_redis, leases, "r")
    now_ms = int(leases_redis.time()[0]) * 1000
    expiry = float(leases_redis.zscore(keys.ticket_expiry("r"), ticket) or 0)
    # it lives the wait it was told (the holder's ttl left) plus the slack, not longer
    assert now_ms < expiry <= now_ms + 5000 + TICKET_SLACK_MS + 1000
    assert 0 < leases_redis.pttl(keys.waiters("r")) <= 5000 + TICKET_SLACK_MS
    assert 0 < leases_redis.pttl(keys.ticket_expiry("r")) <= 5000 + TICKET_SLACK_MS
    leases.store.release(held)
    waiter.finish(SCHEDULING)
    assert waiter.error is None


def _server_calls(client: redis.Redis) -> int:
    """Commands the server ran so far (scripts' inner calls included), INFO excluded."""
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def _calls_of_one_release(leases: Leases, client: redis.Redis, n: int) -> int:
    """Server commands from one release with ``n`` waiters queued until the next grant."""
    resource = f"wake-{n}"
    held = hold_by_hand(leases, resource)
    gate = threading.Event()
    waiters = [Waiter(leases, resource, wait=60, gate=gate) for _ in range(n)]
    for w in waiters:
        w.start()
    poll(lambda: len(queue(client, leases, resource)) == n, 30, f"{n} waiters queued")
    time.sleep(0.2)  # quiet: every waiter sleeps on its channel (the holder is not renewed)
    before = _server_calls(client)
    leases.store.release(held)
    poll(lambda: any(w.granted_at for w in waiters), SCHEDULING, "the first grant")
    after = _server_calls(client)
    assert len(queue(client, leases, resource)) == n - 1  # the others still wait, unwoken
    gate.set()
    for w in waiters:
        w.finish(60)
        assert w.error is None
    return after - before


def test_one_release_wakes_one_waiter_whatever_their_number(make_leases, make_redis_server):
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    # counted from the release to the first waiter's grant; that waiter then holds the
    # lease (and renews nothing: ttl 10, renewed after 3 s) until the count is taken
    one = _calls_of_one_release(leases, client, 1)
    twenty = _calls_of_one_release(leases, client, 20)
    # was ~4 commands per waiter per release (811 at 200); now the same for 1 and for 20
    assert twenty <= one + 10, (one, twenty)


@pytest.mark.parametrize(
    "dead_ticket_expiry_ms",
    [
        # a ticket of a waiter that died, queued first, already run out
        pytest.param(-1, id="run-out"),
        # a process killed while it waited: its ticket is live (far expiry) but its subscriber
        # connection is gone, so the release's PUBLISH reaches nobody and the next is woken
        pytest.param(600_000, id="live-but-nobody-listens"),
    ],
)
def test_a_dead_waiters_ticket_does_not_hold_the_queue(
    leases: Leases, leases_redis, dead_ticket_expiry_ms: int
):
    keys = leases.store.keys
    held = hold_by_hand(leases, "r", ttl=120)
    now_ms = int(leases_redis.time()[0]) * 1000
    leases_redis.zadd(keys.waiters("r"), {"xdeaddeaddead": 1})
    leases_redis.zadd(keys.ticket_expiry("r"), {"xdeaddeaddead": now_ms + dead_ticket_expiry_ms})
    waiter = Waiter(leases, "r", wait=120)
    waiter.start()
    poll(lambda: len(queue(leases_redis, leases, "r")) == 2, SCHEDULING, "the waiter queued")
    released_at = time.monotonic()
    leases.store.release(held)
    waiter.finish(60)
    assert waiter.error is None
    # the release pruned the dead ticket and woke the waiter behind it: far sooner than the
    # live dead ticket's expiry (10 minutes) or the holder's ttl (120 s)
    assert waiter.granted_at is not None
    assert waiter.granted_at - released_at < 60
    assert queue(leases_redis, leases, "r") == []


def test_a_waiter_that_times_out_leaves_and_the_next_is_woken(leases: Leases, leases_redis):
    held = hold_by_hand(leases, "r", ttl=120)
    first = Waiter(leases, "r", wait=3.0)
    first.start()
    poll(lambda: len(queue(leases_redis, leases, "r")) == 1, SCHEDULING, "the first waiter queued")
    (ticket_of_first,) = queue(leases_redis, leases, "r")
    second = Waiter(leases, "r", wait=120)
    second.start()
    # queued behind the first, or alone if the first has left already: either way, next
    poll(
        lambda: set(queue(leases_redis, leases, "r")) - {ticket_of_first},
        SCHEDULING,
        "the second waiter queued",
    )
    first.finish(SCHEDULING)
    assert isinstance(first.error, LeaseBusy)
    # gone as it left, long before its ticket's expiry (the holder's 120 s, plus the slack)
    remaining = queue(leases_redis, leases, "r")
    assert len(remaining) == 1
    assert ticket_of_first not in remaining
    released_at = time.monotonic()
    leases.store.release(held)  # wakes the head, now the second
    second.finish(SCHEDULING)
    assert second.error is None
    assert second.granted_at is not None
    assert second.granted_at - released_at < 60  # woken, not the holder's expiry (120 s)


def test_a_waiter_blocked_elsewhere_leaves_the_queue_it_no_longer_waits_in(
    leases: Leases, leases_redis
):
    held_a = hold_by_hand(leases, "a")
    waiter = Waiter(leases, ["a", "b"], wait=30)
    waiter.start()
    poll(lambda: len(queue(leases_redis, leases, "a")) == 1, SCHEDULING, "queued at a")
    held_b = hold_by_hand(leases, "b")
    leases.store.release(held_a)
    # woken at a, now blocked by b: queued at b only, so a stays free for others
    poll(lambda: len(queue(leases_redis, leases, "b")) == 1, SCHEDULING, "queued at b")
    assert queue(leases_redis, leases, "a") == []
    with leases.hold("a", wait=0):
        pass
    leases.store.release(held_b)
    waiter.finish(SCHEDULING)
    assert waiter.error is None


def test_a_shared_grant_wakes_the_next_shared_waiter(leases: Leases, leases_redis):
    held = hold_by_hand(leases, "s")
    order: list[int] = []
    waiters = []
    for i in range(3):
        w = Waiter(leases, Shared("s"), wait=120, order=order, index=i)
        w.start()
        poll(lambda i=i: len(queue(leases_redis, leases, "s")) == i + 1, SCHEDULING, f"waiter {i}")
        waiters.append(w)
    leases.store.release(held)
    for w in waiters:
        w.finish(SCHEDULING)
        assert w.error is None
    # the grants' order (their tokens grow with each grant): shared holders run side by
    # side, so the order their threads go on in is not the grants' order
    by_token = sorted(range(3), key=lambda i: waiters[i].token)
    assert by_token == [0, 1, 2]


@pytest.mark.asyncio
async def test_asyncio_waiters_are_served_in_order_one_wake_each(make_leases: MakeLeases):
    leases = make_leases()
    client = redis.Redis.from_url(leases.store.url, decode_responses=True)
    try:
        held = hold_by_hand(leases, "r")
        order: list[int] = []
        wakes: list[int] = []

        async def waiter(i: int) -> None:
            async with leases.ahold("r", wait=120, ttl=10):
                order.append(i)
                wakes.append(len(queue(client, leases, "r")))

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(waiter(i)))
            deadline = time.monotonic() + SCHEDULING
            while len(queue(client, leases, "r")) < i + 1:
                assert time.monotonic() < deadline, f"waiter {i} never queued"
                await asyncio.sleep(0.005)
        leases.store.release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), SCHEDULING)
        assert order == [0, 1, 2, 3, 4, 5]
        assert wakes == [5, 4, 3, 2, 1, 0]  # each grant took one ticket out, in turn
    finally:
        client.close()
        await leases.aclose()


@pytest.mark.asyncio
async def test_a_cancelled_asyncio_waiter_leaves_and_wakes_the_next(make_leases: MakeLeases):
    leases = make_leases()
    client = redis.Redis.from_url(leases.store.url, decode_responses=True)
    try:
        hold_by_hand(leases, "r", ttl=120)
        first = asyncio.create_task(leases.ahold("r", wait=120).__aenter__())
        deadline = time.monotonic() + SCHEDULING
        while len(queue(client, leases, "r")) < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        got: list[float] = []

        async def second() -> None:
            async with leases.ahold("r", wait=120, ttl=10):
                got.append(time.monotonic())

        task = asyncio.create_task(second())
        while len(queue(client, leases, "r")) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        client.delete(leases.store.keys.exclusive("r"))  # freed, nobody told
        first.cancel()
        freed_at = time.monotonic()
        await asyncio.wait_for(task, SCHEDULING)
        assert got
        assert got[0] - freed_at < 60  # woken by the leave, not the holder's expiry (120 s)
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        client.close()
        await leases.aclose()
