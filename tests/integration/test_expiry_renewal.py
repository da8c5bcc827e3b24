"""A lease nobody renews runs out on its own; a renewed one outlives its TTL many times over."""

from __future__ import annotations

import time

import pytest

from celery_leases import Leases, Shared
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._sync.driver import LeaseStore
from celery_leases._sync.heartbeat import heartbeat
from tests.support.polling import wait_until


def ident(name: str) -> Identity:
    return Identity(name, "inc", 1)


@pytest.mark.parametrize("mode", ["x", "s"])
def test_an_unrenewed_lease_expires_and_another_owner_gets_it(leases_store: LeaseStore, mode):
    ttl = 0.5
    want = [Want("r", mode, 1 if mode == "s" else 0)]
    sent = time.monotonic()
    first = leases_store.try_acquire(want, ident("a"), ttl)  # no heartbeat: nobody renews it
    assert isinstance(first, list)
    busy = leases_store.try_acquire(want, ident("b"), ttl)
    assert isinstance(busy, Busy)
    assert 0 < busy.wait <= ttl

    second = leases_store.acquire(want, ident("b"), ttl, wait=10 * ttl)
    granted = time.monotonic()

    # Redis counted the TTL from a moment after `sent`, so it cannot have run out earlier
    assert granted - sent >= ttl * 0.95
    # the waiter was woken by the expiry itself, not by the end of its wait
    assert granted - sent < 2 * ttl
    assert second[0].token > first[0].token
    assert [h.owner for h in leases_store.holders("r")] == [ident("b").owner]
    # the first owner's renewal finds the lease gone
    assert leases_store.renew(first, ident("a").owner, timeout=2.0) == {0}
    assert leases_store.release(first) == [False]
    assert leases_store.release(second) == [True]


@pytest.mark.parametrize("shared", [False, True])
def test_renewal_keeps_a_short_lease_for_many_ttls(leases: Leases, leases_redis, shared):
    ttl = 0.6
    resource = Shared("r", limit=1) if shared else "r"
    want = [Want("r", "s", 1) if shared else Want("r")]
    key = leases.store.keys.shared("r") if shared else leases.store.keys.exclusive("r")
    rival = ident("rival")
    attempts = 0
    with leases.hold(resource, ttl=ttl) as lease:
        start = time.monotonic()
        while time.monotonic() - start < 5 * ttl:
            outcome = leases.store.try_acquire(want, rival, ttl)
            assert isinstance(outcome, Busy), "the rival took a lease that was being renewed"
            attempts += 1
            lease.check()
            assert 0 < lease.expires_in <= ttl
            assert leases_redis.pttl(key) > 0
            time.sleep(ttl / 20)  # pacing of the rival's attempts
        assert not lease.lost
        token = lease.token
    assert attempts >= 20
    assert lease.expires_in == 0.0
    # released: the rival gets it at once, with a larger token
    got = leases.store.try_acquire(want, rival, ttl)
    assert isinstance(got, list)
    assert got[0].token > token
    leases.store.release(got)


def test_expires_in_counts_down_between_renewals(leases: Leases):
    with leases.hold("r", ttl=30) as lease:
        first = lease.expires_in
        time.sleep(0.05)
        second = lease.expires_in
    assert 0 < second < first <= 30


def test_a_stopped_heartbeat_starts_again_at_the_next_lease(leases: Leases) -> None:
    # add() starts a thread again once the last one ended (it tracks that itself rather
    # than asking Thread.is_alive() at every add)
    beat = heartbeat()
    with leases.hold("beat:before", ttl=3.0):
        pass
    beat.stop(10)
    assert beat._thread is not None
    assert not beat._thread.is_alive()
    before = beat.renewals
    with leases.hold("beat:after", ttl=3.0) as lease:
        wait_until(lambda: beat.renewals > before, 15, "a renewal by a new heartbeat thread")
        assert not lease.lost
