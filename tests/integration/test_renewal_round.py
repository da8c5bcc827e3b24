"""A lease added while a renewal round is in flight is planned: the round's end keeps the
sooner renewal it needs (it used to overwrite it with the round's own interval, and the new
lease was reported lost although Redis still held it)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._redis_server import RedisServer
from celery_leases._sync.driver import LeaseStore
from celery_leases._sync.heartbeat import Heartbeat
from celery_leases.config import resolve_settings
from tests.support.polling import wait_until

OWNER = Identity("worker-a@host", "inca", 101)


@pytest.fixture
def slow_redis() -> Iterator[RedisServer]:
    """A private server this test may freeze (SIGSTOP) without touching anyone else's."""
    with RedisServer() as srv:
        yield srv


def _grant(store: LeaseStore, name: str, ttl: float) -> Held:
    got = store.try_acquire([Want(name)], OWNER, ttl)
    assert isinstance(got, list)
    return got[0]


def test_a_lease_added_during_a_slow_round_is_renewed_in_time(slow_redis: RedisServer) -> None:
    store = LeaseStore(resolve_settings(None, redis_url=slow_redis.url, ttl=12.0))
    beat = Heartbeat()
    try:
        long = _grant(store, "long", 12.0)  # renewed every 12 * 0.9 / 3 = 3.6 s
        beat.add(long, store)
        # just before that round: a lease that must be renewed within 2.7 s of its grant
        wait_until(lambda: time.monotonic() >= long.confirmed_at + 3.2, 10, "the round")
        short = _grant(store, "short", 3.0)
        # t0 the round of `long` starts and hangs on a frozen Redis; t1 `short` is added (due
        # at once after 0.9 s); t2 the round ends: it must not plan the next round 3.6 s
        # after its own start, past `short`'s deadline
        slow_redis.pause()
        try:
            wait_until(lambda: beat.renewals >= 1, 10, "the round to start")
            beat.add(short, store)
            time.sleep(0.3)
        finally:
            slow_redis.resume()
        wait_until(lambda: short.confirmed_at > short.acquired_at, 10, "short's renewal")
        assert not short.lost
        assert [h.token for h in store.holders("short")] == [short.token]
    finally:
        beat.stop(5)
        store.close()
