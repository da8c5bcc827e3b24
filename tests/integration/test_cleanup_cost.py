"""Cleanup costs O(leases held), whatever the size of the keyspace, and never scans it.

Commands are counted with INFO commandstats on a private Redis (CONFIG RESETSTAT between).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis

from celery_leases import Shared, _cleanup
from celery_leases._cleanup import CleanupReport
from celery_leases._engine import LeaseEngine
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._protocol import Steps
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import resolve_settings
from tests.support.polling import wait_until

T = TypeVar("T")
PREFIX = "cost"
RESOURCES = [f"res:{i}" for i in range(5)]


@pytest.fixture
def server(make_redis_server):
    return make_redis_server()


@pytest.fixture
def admin(server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.ping()  # connect now: its handshake must not land inside a measurement
    yield client
    client.close()


@pytest.fixture
def store(server) -> Iterator[LeaseStore]:
    s = LeaseStore(resolve_settings(None, redis_url=server.url, key_prefix=PREFIX))
    s.load_scripts()  # so no SCRIPT LOAD lands inside a measurement
    yield s
    s.close()


def counted(admin: redis.Redis, action: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """Run ``action``; return its result and the commands Redis executed meanwhile."""
    admin.config_resetstat()
    result = action()
    stats = admin.info("commandstats")
    calls = {
        name.removeprefix("cmdstat_"): int(values["calls"])
        for name, values in stats.items()
        if not name.startswith(("cmdstat_info", "cmdstat_config"))  # the measuring client's
    }
    assert "scan" not in calls
    assert "keys" not in calls
    return result, calls


def fill(admin: redis.Redis, total: int) -> None:
    """Unrelated keys, up to ``total`` keys in the database."""
    have = admin.dbsize()
    for start in range(have, total, 5000):
        admin.mset({f"unrelated:{i}": "x" for i in range(start, min(total, start + 5000))})
    assert admin.dbsize() >= total


def test_cleanup_owner_costs_the_same_whatever_the_keyspace(admin, store):
    costs = []
    for size, node in ((100, "small"), (50_000, "large")):
        fill(admin, size)
        ident = Identity(node, "dead", 1)
        held = store.try_acquire([Want(r) for r in RESOURCES], ident, 30.0)
        assert isinstance(held, list)

        report, calls = counted(admin, lambda ident=ident: store.cleanup_owner(ident.owner))

        assert sorted(report.released) == [(ident.owner, r) for r in RESOURCES]
        assert all(store.holders(r) == [] for r in RESOURCES)
        costs.append(calls)
    small, large = costs
    # commandstats counts the commands the scripts run too: all of them must match
    assert small == large
    # top level, a handful: read the registry, release what it lists, forget the owner
    assert small["smembers"] == 1
    assert small["evalsha"] == 2


def test_cleanup_owner_cost_grows_with_the_leases_not_the_keyspace(admin, server):
    groups = 8
    store = LeaseStore(
        resolve_settings(None, redis_url=server.url, key_prefix=PREFIX, slot_groups=groups)
    )
    try:
        store.load_scripts()
        costs = []
        for size, node in ((100, "small"), (50_000, "large")):
            fill(admin, size)
            ident = Identity(node, "dead", 1)
            names = [f"{node}:{i}" for i in range(40)]
            held = store.try_acquire([Want(n) for n in names], ident, 30.0)
            assert isinstance(held, list)
            report, calls = counted(admin, lambda ident=ident: store.cleanup_owner(ident.owner))
            assert len(report.released) == len(names)
            costs.append(calls)
        assert costs[0] == costs[1]
        # one registry read per slot group, a release per group that had leases, one forget
        assert costs[0]["smembers"] == groups
        assert costs[0]["evalsha"] <= groups + 1
    finally:
        store.close()


def test_a_large_registry_is_released_in_bounded_batches(admin, store):
    # one script call per 500 leases, so a dead owner of thousands never blocks Redis long
    ident = Identity("hoarder", "dead", 1)
    names = [f"hoard:{i}" for i in range(1_200)]
    for start in range(0, len(names), 300):
        held = store.try_acquire([Want(n) for n in names[start : start + 300]], ident, 30.0)
        assert isinstance(held, list)
    report, calls = counted(admin, lambda: store.cleanup_owner(ident.owner))
    assert len(report.released) == len(names)
    assert calls["evalsha"] == 3 + 1  # three release batches, then forget the owner
    assert store.holders(names[-1]) == []


def test_cleanup_node_without_a_past_costs_one_command(admin, store):
    fill(admin, 10_000)
    report, calls = counted(admin, lambda: store.cleanup_node("brand-new@host"))
    assert report.owners == []
    assert report.released == []
    assert calls == {"smembers": 1}


def test_cleanup_node_frees_earlier_incarnations_only(admin, store):
    old = Identity("pod-1", "old", 7)
    new = Identity("pod-1", "new", 7)
    assert isinstance(store.try_acquire([Want("a"), Want("b", "s")], old, 30.0), list)
    assert isinstance(store.try_acquire([Want("c")], new, 30.0), list)

    report = store.cleanup_node("pod-1", keep_incarnation="new")

    assert sorted(report.released) == [(old.owner, "a"), (old.owner, "b")]
    assert store.holders("a") == store.holders("b") == []
    assert [h.owner for h in store.holders("c")] == [new.owner]
    assert store.node_owners("pod-1") == [new.owner]


CHILD = textwrap.dedent(
    """
    import sys, time
    from celery import Celery
    from celery_leases import Leases, Shared

    # settings.ttl is the owner's liveness: tiny; the leases themselves live much longer
    leases = Leases(Celery("doomed", set_as_current=False), redis_url=sys.argv[1],
                    key_prefix=sys.argv[2], node="doomed", ttl=0.3)
    with leases.hold(["r1", "r2", Shared("s")], ttl=30):
        print(leases.identity().owner, flush=True)
        time.sleep(600)
    """
)


def test_reconcile_frees_a_dead_owner_and_leaves_live_ones(server, make_leases):
    live = make_leases(redis_url=server.url, key_prefix=PREFIX, node="alive", ttl=0.6)
    store = live.store
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, server.url, PREFIX],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        dead = proc.stdout.readline().strip()
        assert dead, proc.communicate()[1]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    with live.hold(["mine", Shared("s")], ttl=30) as (mine, _):
        deadline = time.monotonic() + 10
        while dead not in store.expired_owners():
            assert time.monotonic() < deadline, "the dead owner's liveness never ran out"
            time.sleep(0.05)
        # the killed holder's leases are still in Redis: only their owner's liveness ran out
        assert [h.owner for h in store.holders("r1")] == [dead]

        report = store.reconcile()

        assert report.owners == [dead]
        assert sorted(report.released) == [(dead, "r1"), (dead, "r2"), (dead, "s")]
        assert report.errors == []
        assert store.holders("r1") == store.holders("r2") == []
        assert [h.owner for h in store.holders("s")] == [live.identity().owner]
        mine.check()
        assert [h.owner for h in store.holders("mine")] == [live.identity().owner]
        assert dead not in [o for o, _ in store.owners()]
        assert live.identity().owner in [o for o, _ in store.owners()]
        with live.hold(["r1", "r2"]):
            pass
        # a second pass finds nothing more to do
        assert store.reconcile().owners == []


def test_reconcile_costs_nothing_without_dead_owners(admin, server, make_leases):
    live = make_leases(redis_url=server.url, key_prefix=PREFIX, node="alive")
    fill(admin, 20_000)
    with live.hold(["a", "b"]):
        live.store.load_scripts()
        report, calls = counted(admin, live.store.reconcile)
    assert report.owners == []
    # one script call lists the expired owners (inside it: TIME and one ZRANGEBYSCORE); the
    # heartbeat renews every 9 s, and might add one more script call in the window
    assert calls["evalsha"] in (1, 2)
    assert calls["zrangebyscore"] == 1
    assert "smembers" not in calls


def test_reconcile_spares_a_lease_taken_after_its_owner_was_found_expired(server, monkeypatch):
    """t0 an idle process's liveness has run out (it holds nothing, so nothing renews it);
    t1 reconcile lists it as expired; t2 the process takes a new lease (alive again); t3
    reconcile cleans the owner up: it must not free the lease of t2."""
    store = LeaseStore(resolve_settings(None, redis_url=server.url, key_prefix=PREFIX, ttl=0.2))
    idle = Identity("idle", "inc", 1)
    try:
        first = store.try_acquire([Want("earlier")], idle, 0.2)
        assert isinstance(first, list)
        assert store.release(first) == [True]
        deadline = time.monotonic() + 10
        while idle.owner not in store.expired_owners():
            assert time.monotonic() < deadline, "the idle owner's liveness never ran out"
            time.sleep(0.05)

        original = _cleanup.cleanup_owner_isolated
        taken = []

        def racing(engine: LeaseEngine, owner: str, **kwargs: Any) -> Steps[CleanupReport]:
            if owner == idle.owner and not taken:
                got = store.try_acquire([Want("fresh")], idle, 30.0)  # t2
                assert isinstance(got, list)
                taken.extend(got)
            return (yield from original(engine, owner, **kwargs))

        monkeypatch.setattr(_cleanup, "cleanup_owner_isolated", racing)
        report = store.reconcile()

        assert taken, "reconcile never looked at the idle owner"
        assert report.released == []
        assert [h.owner for h in store.holders("fresh")] == [idle.owner]
        assert store.renew(taken, idle.owner, timeout=2.0) == set()
        assert idle.owner in [o for o, _ in store.owners()]
    finally:
        store.close()


@pytest.mark.parametrize("slot_groups", [1, 8])
def test_reconcile_never_frees_a_lease_its_holder_still_counts_held(server, slot_groups):
    """t0 an owner takes and gives back a lease (its liveness runs to t0 + ttl); t1 it takes
    another lease, which it counts held until t1 + horizon, later than t0 + ttl; t2 (between
    the two) a reconcile finds the owner's liveness run out. It must not free the lease of t1:
    its holder would learn only at its next renewal, after someone else was granted it.
    (Regression: the grant at t1 skipped refreshing a liveness that looked fresh enough.)"""
    ttl = 2.0
    store = LeaseStore(
        resolve_settings(
            None, redis_url=server.url, key_prefix=PREFIX, ttl=ttl, slot_groups=slot_groups
        )
    )
    quiet = Identity("quiet", "inc", 1)
    try:
        t0 = time.monotonic()
        first = store.try_acquire([Want("earlier")], quiet, ttl)
        assert isinstance(first, list)
        assert store.release(first) == [True]
        wait_until(lambda: time.monotonic() >= t0 + 0.7 * ttl, 5, "t1")  # in the old "fresh" window
        taken = store.try_acquire([Want("later")], quiet, ttl)
        assert isinstance(taken, list)
        (held,) = taken
        wait_until(lambda: time.monotonic() >= t0 + 1.1 * ttl, 5, "t2")  # t0's liveness ran out
        report = store.reconcile()
        checked = time.monotonic()
        assert checked < held.deadline, "too slow to show anything: the lease's horizon passed"
        assert report.released == []
        assert [h.owner for h in store.holders("later")] == [quiet.owner]
    finally:
        store.close()


def test_an_owner_forgotten_by_reconcile_registers_again_under_its_node(server):
    """t0 an owner registers; t1 it idles past its liveness and reconcile forgets it; t2 it
    takes a lease outside the home slot group; t3 its node restarts: cleanup_node must find
    that lease."""
    store = LeaseStore(
        resolve_settings(None, redis_url=server.url, key_prefix=PREFIX, ttl=0.2, slot_groups=8)
    )
    ident = Identity("pod-7", "old", 1)
    away = next(f"r{i}" for i in range(100) if store.keys.group_of(f"r{i}") != 0)
    try:
        first = store.try_acquire([Want(away)], ident, 0.2)
        assert isinstance(first, list)
        store.release(first)
        assert store.node_owners("pod-7") == [ident.owner]
        deadline = time.monotonic() + 10
        while ident.owner not in store.expired_owners():
            assert time.monotonic() < deadline, "the owner's liveness never ran out"
            time.sleep(0.05)
        assert store.reconcile().owners == [ident.owner]
        assert store.node_owners("pod-7") == []

        again = store.try_acquire([Want(away)], ident, 30.0)
        assert isinstance(again, list)
        assert store.node_owners("pod-7") == [ident.owner]
        report = store.cleanup_node("pod-7", keep_incarnation="new")
        assert report.released == [(ident.owner, away)]
    finally:
        store.close()
