"""The engine on a real Redis Cluster and behind real sentinels: same behaviour as one server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_leases import LeaseBusy, LeaseLost, LeaseRevoked, Leases, Shared
from celery_leases._connect import parse_target
from celery_leases._identity import Identity
from celery_leases._lease import Want
from tests.support.polling import wait_until
from tests.support.topologies import (
    CLUSTER_SLOT_GROUPS,
    Topology,
    check_a_waiter_is_woken_by_the_release,
    command_calls,
    leases_factory,
    reset_stats,
    resources_in_distinct_groups,
)

APP = "tests.integration.worker.worker_app"


@pytest.fixture
def make(topology: Topology) -> Iterator[Callable[..., Leases]]:
    with leases_factory(
        topology.url, f"topo-{uuid.uuid4().hex[:8]}", **topology.settings
    ) as make_leases:
        yield make_leases


def test_the_url_selects_the_client(topology: Topology, make: Callable[..., Leases]) -> None:
    leases = make()
    assert parse_target(topology.url).kind == topology.name
    assert leases.store.ping()
    assert type(leases.store.client).__name__ == (
        "RedisCluster" if topology.name == "cluster" else "Redis"
    )


def test_exclusive_shared_and_limit(make: Callable[..., Leases]) -> None:
    leases = make()
    with leases.hold("x:1", ttl=10) as first:
        with pytest.raises(LeaseBusy) as busy:
            leases.acquire([Want("x:1")])
        assert busy.value.resource == "x:1"
    with leases.hold("x:1", ttl=10) as second:
        assert second.token > first.token
    with leases.hold([Shared("s:1", limit=2), Shared("s:2")]) as (a, _):
        with leases.hold(Shared("s:1", limit=2)) as b:
            assert b.token > a.token
            with pytest.raises(LeaseBusy):
                leases.acquire([Want("s:1", "s", 2)])
        with pytest.raises(LeaseBusy):
            leases.acquire([Want("s:2")])  # exclusive against a shared holder


def test_many_slot_groups_are_all_or_nothing(topology: Topology, make: Callable[..., Leases]):
    leases = make()
    names = resources_in_distinct_groups(leases, 6)
    groups = {leases.store.keys.group_of(n) for n in names}
    assert len(groups) == (6 if topology.name == "cluster" else 1)
    # the last group in acquisition order is busy: every earlier group's grant is rolled back
    last = max(names, key=leases.store.keys.group_of)
    with leases.hold(last, ttl=10):
        other = make(node="other-node")
        with pytest.raises(LeaseBusy) as busy:
            other.acquire([Want(n) for n in names])
        assert busy.value.resource == last
        for name in names:
            holders = leases.store.holders(name)
            assert [h.owner for h in holders] == ([leases.identity().owner] if name == last else [])
        assert other.store.entries(other.identity().owner) == []
    with leases.hold(names, ttl=10) as held:
        assert [h.resource for h in held] == names


def test_the_history_spans_the_slot_groups(topology: Topology, make: Callable[..., Leases]):
    # each script writes its own slot group's streams; a fleet-wide read merges them
    leases = make(history=1000)
    names = resources_in_distinct_groups(leases, 6)
    with leases.hold(names, ttl=10):
        record = leases.store.lease_record(names[-1])
        assert record["transitions"] == 1
        assert [e["event"] for e in record["history"]] == ["granted"]
    events = leases.store.history(count=100)
    assert sorted(e["resource"] for e in events if e["event"] == "released") == sorted(names)
    assert len(events) == 2 * len(names)
    assert leases.store.history(resource=names[0])[0]["event"] == "released"


def test_crossing_requests_never_deadlock(make: Callable[..., Leases]) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 4)
    done: list[int] = []
    errors: list[BaseException] = []

    def worker(order: list[str]) -> None:
        try:
            for _ in range(15):
                with leases.hold(order, ttl=10, wait=30):
                    pass
            done.append(1)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(order,))
        for order in (names, names[::-1], names[1:] + names[:1], names[::-1])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert len(done) == 4


def test_a_waiter_is_woken_by_the_release(make: Callable[..., Leases]) -> None:
    leases = make()
    got = threading.Event()
    tokens: list[int] = []
    holder = leases.hold("w:1", ttl=3600)  # only a release can free it in this test's time
    lease = holder.__enter__()

    def waiter() -> None:
        with leases.hold("w:1", ttl=10, wait=120) as second:
            tokens.append(second.token)
            got.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: leases.store.holders("w:1") != [], 10, "the holder holds")
    assert not got.is_set()
    holder.__exit__(None, None, None)
    assert got.wait(60), "the waiter was not woken by the release"
    thread.join(10)
    assert tokens[0] > lease.token


def test_the_heartbeat_keeps_leases_past_their_ttl(make: Callable[..., Leases]) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 3)
    with leases.hold(names, ttl=1.0) as held:
        deadline = time.monotonic() + 3.0  # three TTLs: renewed every ttl/3 on every node
        while time.monotonic() < deadline:
            for h in held:
                h.check()
            time.sleep(0.1)
        for name in names:
            assert [h.owner for h in leases.store.holders(name)] == [leases.identity().owner]


def test_a_lost_lease_is_reported(make: Callable[..., Leases]) -> None:
    leases = make()
    # the loss is noticed while inside, and leaving the block says so
    with pytest.raises(LeaseLost), leases.hold("lost:1", ttl=1.0) as lease:  # noqa: PT012
        key = leases.store.resource_keys("lost:1").exclusive
        leases.store.client.delete(key)  # as a failover to a replica without it would
        wait_until(lambda: _lost(lease), 10, "the loss is noticed")


def _lost(lease: Any) -> bool:
    try:
        lease.check()
    except LeaseLost:
        return True
    return False


def test_cleanup_of_a_dead_owner_reads_its_registries_only(
    topology: Topology, make: Callable[..., Leases]
) -> None:
    leases = make()
    store = leases.store
    dead = Identity("dead-node@host", "inc1", 4242)
    names = [f"dead:{i}" for i in range(40)]
    held = store.try_acquire([Want(n) for n in names[:20]], dead, 60.0)
    assert isinstance(held, list)
    held2 = store.try_acquire([Want(n, "s", 0) for n in names[20:]], dead, 60.0)
    assert isinstance(held2, list)
    store.load_scripts()
    reset_stats(topology.servers)

    report = store.cleanup_owner(dead.owner, dead=True)

    calls = command_calls(topology.servers)
    assert sorted(r for _, r in report.released) == sorted(names)
    assert "scan" not in calls
    assert "keys" not in calls
    # one read of each slot group's registry, then one release call per group (plus the
    # forget of the owner): O(leases held + slot groups)
    groups = store.settings.slot_groups
    scripts = calls.get("evalsha", 0) + calls.get("eval", 0)
    assert calls.get("smembers", 0) == groups
    assert scripts <= groups + 2
    for name in names:
        assert store.holders(name) == []


def test_reconcile_frees_an_owner_whose_liveness_ran_out(make: Callable[..., Leases]) -> None:
    leases = make(ttl=0.5)
    store = leases.store
    dead = Identity("gone-node@host", "inc2", 4343)
    names = resources_in_distinct_groups(leases, 5)
    assert isinstance(store.try_acquire([Want(n) for n in names], dead, 60.0), list)
    wait_until(lambda: dead.owner in store.expired_owners(), 10, "the liveness runs out")
    report = store.reconcile()
    assert report.owners == [dead.owner]
    assert sorted(r for _, r in report.released) == sorted(names)
    for name in names:
        assert store.holders(name) == []


def test_once_runs_the_initializer_once(make: Callable[..., Leases]) -> None:
    leases = make()
    calls: list[int] = []
    results: list[Any] = []
    barrier = threading.Barrier(6)

    def init() -> dict[str, int]:
        calls.append(1)
        time.sleep(0.2)
        return {"rows": 7}

    def caller() -> None:
        barrier.wait()
        results.append(leases.once("input:1", init, wait=60))

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert calls == [1]
    assert results == [{"rows": 7}] * 6
    assert leases.receipt("input:1") == {"rows": 7}
    assert leases.forget("input:1")


def test_beat_claim_is_given_once(make: Callable[..., Leases]) -> None:
    a, b = make(), make()
    wins = [
        s.store.beat_claim("entry", due_ms=1234, bucket=None, replica=name, keep=60.0)
        for s, name in ((a, "a"), (b, "b"))
    ]
    assert sorted(w[0] for w in wins) == [False, True]
    assert wins[0][3] == wins[1][3] == "a"
    # interval runs: one claim per Redis-time bucket
    every = [
        s.store.beat_claim("tick", due_ms=None, bucket=3600.0, replica=name, keep=60.0)
        for s, name in ((a, "a"), (b, "b"))
    ]
    assert [w[0] for w in every] == [True, False]


def test_cli_lists_and_shows(
    topology: Topology, make: Callable[..., Leases], leases_redis_url: str
) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "LEASES_TEST_BROKER": leases_redis_url,  # the broker is not under test here
            "CELERY_LEASES_KEY_PREFIX": leases.settings.key_prefix,
            **topology.env(),
        }
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "celery", "-A", APP, "leases", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    with leases.hold(names, ttl=30):
        out = cli("ls", "--json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert {row["resource"] for row in rows} == set(names)
        assert {row["owner"] for row in rows} == {leases.identity().owner}
        out = cli("show", names[-1])
        assert out.returncode == 0, out.stderr
        assert leases.identity().owner in out.stdout
        out = cli("owners")
        assert out.returncode == 0, out.stderr
        assert leases.identity().owner in out.stdout
    out = cli("ls", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


@pytest.mark.asyncio
async def test_the_asyncio_api_on_the_deployment(make: Callable[..., Leases]) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 3)
    try:
        async with leases.ahold(names, ttl=1.0) as held:
            with pytest.raises(LeaseBusy):
                leases.acquire([Want(names[0])])  # the sync side sees the async grant
            await asyncio.sleep(1.5)  # renewed past its ttl by the loop's heartbeat task
            for lease in held:
                lease.check()
        await check_a_waiter_is_woken_by_the_release(leases, names[-1], 60)
        # a new store's first grant, of one resource: where it lies outside slot group 0,
        # the owner's home call is sent with it (to two nodes at once on a cluster)
        other = make()
        try:
            async with other.ahold(names[-1], ttl=10) as lease:
                assert [h.token for h in leases.store.holders(names[-1])] == [lease.token]
                ident = other.identity()
                assert ident.owner in other.store.node_owners(ident.node)
        finally:
            await other.aclose()
        assert await leases.aonce(f"ainit:{names[0]}", lambda: {"ok": 1}) == {"ok": 1}
    finally:
        await leases.aclose()


def test_a_cluster_client_never_replays_a_script_call_itself(redis_cluster: Any) -> None:
    """A cluster client retries a failed command on its own (3 times by default); inside a
    script call (one_attempt) it must not: the call's reply may be lost after it ran."""
    from celery_leases._one_attempt import one_attempt

    with leases_factory(redis_cluster.url, f"topo-{uuid.uuid4().hex[:8]}") as make_leases:
        leases = make_leases(slot_groups=CLUSTER_SLOT_GROUPS)
        client: Any = leases.store.client
        assert client.retry.get_retries() > 0  # reads keep the cluster's own retry
        with one_attempt():
            assert client.retry.get_retries() == 0

        async def check() -> None:
            astore = leases.astore
            state: Any = astore._state()
            try:
                assert state.client.retry.get_retries() > 0
                with one_attempt():
                    assert state.client.retry.get_retries() == 0
            finally:
                await astore.aclose()

        asyncio.run(check())
        with leases.hold("r") as lease:  # and the engine works as before
            assert lease.token > 0


def test_revocation_in_several_slot_groups(make: Callable[..., Leases]) -> None:
    """revoke.lua and renew.lua read the mark in the resource's own slot group: the holder of
    leases in several groups learns of the one revoked, and only of it (issue 31)."""
    leases = make(ttl=1.5)
    names = resources_in_distinct_groups(leases, 3)
    with leases.hold(names, ttl=1.5) as held:
        done = leases.revoke(names[1], reason="topology", deadline=20)
        assert done.tokens == (held[1].token,)

        def learnt() -> str | None:
            try:
                held[1].check()
            except LeaseRevoked as exc:
                return exc.reason
            return None

        assert wait_until(learnt, 20, "the holder to learn of it") == "topology"
        held[0].check()
        held[2].check()
