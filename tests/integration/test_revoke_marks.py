"""The revocation mark against a real Redis: it covers the grants held when it was written,
never a later one, and never outlives its deadline (lua/revoke.lua, lua/renew.lua)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from celery_leases import Lease, LeaseRevoked, Leases, Shared
from tests.support.polling import wait_until


def _revoked(lease: Lease) -> bool:
    try:
        lease.check()
    except LeaseRevoked:
        return True
    return False


def test_nothing_held_writes_no_mark(make_leases, leases_redis: redis.Redis) -> None:
    leases: Leases = make_leases(ttl=3)
    done = leases.revoke("idle", reason="x", deadline=5)
    assert (done.holders, done.tokens, done.deadline) == ((), (), 0.0)
    assert leases_redis.exists(leases.store.keys.revocation("idle")) == 0


def test_the_mark_expires_at_the_deadline_and_never_gives_more_time(
    make_leases, leases_redis: redis.Redis
) -> None:
    leases: Leases = make_leases(ttl=30)
    mark = leases.store.keys.revocation("r")
    with leases.hold("r") as lease:
        first = leases.revoke("r", reason="a", deadline=5)
        assert first.tokens == (lease.token,)
        assert 0 < leases_redis.pttl(mark) <= 5000
        # the lease itself runs out at the deadline now, whatever its ttl
        assert 0 < leases_redis.pttl(leases.store.keys.exclusive("r")) <= 5000
        again = leases.revoke("r", reason="b", deadline=60)
        assert again.deadline <= first.deadline
        assert leases_redis.pttl(mark) <= 5000
        assert leases_redis.get(mark).endswith(f" {lease.token} b")


def test_a_later_holder_is_not_covered_by_an_earlier_mark(make_leases) -> None:
    """t0 A holds; t1 revoke (deadline 30 s); t2 A releases at once; t3 B is granted while
    the mark still lives: B's renewals must not report it revoked, nor cut its lease."""
    leases: Leases = make_leases(ttl=1.5)
    with leases.hold("r") as a:
        leases.revoke("r", reason="go", deadline=30)
        wait_until(lambda: _revoked(a), 10, "A learns of it")
    with leases.hold("r") as b:
        assert b.token > a.token
        time.sleep(3 * 1.5)  # several renewals, and well past a 1.5 s ttl
        b.check()
        assert b.expires_in > 0


def test_every_shared_holder_is_asked(make_leases) -> None:
    leases: Leases = make_leases(ttl=1.5)
    learnt: list[str] = []

    def hold(name: str, go: threading.Event) -> None:
        with leases.hold(Shared("pool")) as lease:
            go.wait(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    lease.check()
                except LeaseRevoked as exc:
                    learnt.append(f"{name} {exc.reason}")
                    return
                time.sleep(0.02)

    gates = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=hold, args=(n, g)) for n, g in zip("ab", gates, strict=True)]
    for t in threads:
        t.start()
    wait_until(lambda: len(leases.store.holders("pool")) == 2, 10, "two shared holders")
    done = leases.revoke("pool", reason="drain", deadline=20)
    assert len(done.holders) == 2
    for g in gates:
        g.set()
    for t in threads:
        t.join(20)
    assert sorted(learnt) == ["a drain", "b drain"]


@pytest.mark.asyncio
async def test_an_asyncio_holder_learns_it_too(make_leases) -> None:
    """The asyncio heartbeat runs the same renewal round: check() raises LeaseRevoked."""
    leases: Leases = make_leases(ttl=1.5)
    async with leases.ahold("aio") as lease:
        leases.revoke("aio", reason="loop", deadline=20)
        deadline = time.monotonic() + 20
        while not _revoked(lease):
            assert time.monotonic() < deadline, "the asyncio holder never learnt of it"
            await asyncio.sleep(0.02)
    await leases.aclose()
