"""The lease record and the history: every event kind, per resource and fleet-wide."""

from __future__ import annotations

import time

import pytest

from celery_leases import LeaseBusy, LeaseLost, Shared
from celery_leases._lease import Want
from tests.support.polling import wait_until


def _kinds(events):
    return [e["event"] for e in events]


def test_without_the_setting_nothing_is_written(make_leases, leases_redis, leases_prefix):
    leases = make_leases()  # history=0, the default
    with leases.hold("quiet", ttl=5) as lease:
        record = leases.store.lease_record("quiet")
        assert record["transitions"] is None
        assert record["history"] == []
        assert record["renewed_at"] is None  # the ttl is not known without the history
        assert record["granted_at"] == lease.token / 1e6
    assert leases.store.history() == []
    assert not list(leases_redis.scan_iter(f"*{leases_prefix}*:h*"))


def test_a_grant_and_its_release(make_leases):
    leases = make_leases(history=100)
    before = leases.store.redis_time()
    with leases.hold("rec:1", ttl=5) as lease:
        record = leases.store.lease_record("rec:1")
    after = leases.store.redis_time()
    (holder,) = record["holders"]
    assert holder["owner"] == leases.identity().owner
    assert holder["node"] == leases.identity().node
    assert holder["token"] == lease.token
    assert holder["mode"] == "exclusive"
    assert 0 < holder["ttl_left"] <= 5
    # the grant was made at or before token / 1e6, and after the clock read before it
    assert before <= record["granted_at"] <= after
    assert record["granted_at"] == lease.token / 1e6
    assert record["renewed_at"] is not None
    assert before - 0.01 <= record["renewed_at"] <= after
    assert record["transitions"] == 1
    assert record["waiters"] == 0
    assert record["mode"] == "exclusive"
    assert _kinds(record["history"]) == ["granted"]
    (granted,) = record["history"]
    assert (granted["token"], granted["ttl"], granted["resource"]) == (lease.token, 5.0, "rec:1")
    events = leases.store.history(resource="rec:1")
    assert _kinds(events) == ["released", "granted"]
    assert events[0]["token"] == lease.token
    assert events[0]["owner"] == holder["owner"]
    assert events[0]["at"] >= events[1]["at"]
    after_release = leases.store.lease_record("rec:1")
    assert after_release["holders"] == []
    assert after_release["transitions"] == 1


def test_transitions_count_each_change_of_hands(make_leases):
    leases = make_leases(history=100)
    for _ in range(3):
        with leases.hold("hands", ttl=5):
            pass
    with leases.hold("hands", ttl=5):
        assert leases.store.lease_record("hands")["transitions"] == 4


def test_busy_events_name_the_refused_caller_and_the_wait(make_leases):
    leases = make_leases(history=100)
    with leases.hold("b:1", ttl=5), pytest.raises(LeaseBusy):
        leases.acquire([Want("b:1")], task_id="t-refused")
    events = leases.store.history(resource="b:1")
    assert _kinds(events) == ["released", "busy", "granted"]
    busy = events[1]
    assert busy["task_id"] == "t-refused"
    assert busy["token"] is None
    assert 0 < busy["wait"] <= 5


def test_waiters_count_live_tickets(make_leases):
    import threading

    leases = make_leases(history=100)
    outcome = []
    with leases.hold("w:1", ttl=5):

        def wait() -> None:
            with leases.hold("w:1", ttl=5, wait=10):
                outcome.append("granted")

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(
            lambda: leases.store.lease_record("w:1")["waiters"] == 1,
            timeout=10,
            what="the waiter queues",
        )
    waiter.join(10)
    assert outcome == ["granted"]
    assert leases.store.lease_record("w:1")["waiters"] == 0


def test_shared_holders_in_the_record(make_leases):
    leases = make_leases(history=100)
    with leases.hold(Shared("sh:1", limit=3), ttl=5) as a, leases.hold(Shared("sh:1"), ttl=8) as b:
        record = leases.store.lease_record("sh:1")
    assert record["mode"] == "shared"
    assert sorted(h["token"] for h in record["holders"]) == sorted([a.token, b.token])
    assert record["granted_at"] == min(a.token, b.token) / 1e6
    assert record["transitions"] == 2


def test_an_expired_lease_released_late(make_leases):
    leases = make_leases(history=100, ttl=1.0)
    # taken from the store: no heartbeat renews it
    (held,) = leases.store.try_acquire([Want("late")], leases.identity(), 0.3)
    wait_until(lambda: leases.store.holders("late") == [], timeout=10, what="expiry")
    assert leases.store.release([held]) == [False]
    assert _kinds(leases.store.history(resource="late")) == ["expired", "granted"]


def test_a_lost_lease(make_leases, leases_redis):
    leases = make_leases(history=100)
    tokens = []

    def hold_while_it_is_taken() -> None:
        with leases.hold("gone", ttl=3) as lease:
            tokens.append(lease.token)
            leases_redis.delete(leases.store.keys.exclusive("gone"))  # taken from under it
            wait_until(
                lambda: "lost" in _kinds(leases.store.history(resource="gone")),
                timeout=10,
                what="the renewal finds the lease gone",
            )

    with pytest.raises(LeaseLost):
        hold_while_it_is_taken()
    events = leases.store.history(resource="gone")
    assert _kinds(events)[:2] == ["lost", "granted"]
    assert events[0]["token"] == tokens[0]


def test_freed_by_a_cleanup_and_by_a_reconcile(make_leases):
    leases = make_leases(history=100)
    owner = leases.identity().owner
    (a,) = leases.store.try_acquire([Want("c:1")], leases.identity(), 5.0)
    leases.store.cleanup_owner(owner, dead=True)
    (freed,) = [e for e in leases.store.history(resource="c:1") if e["event"] == "freed"]
    assert freed["by"] == "cleanup"
    assert freed["token"] == a.token
    leases.store.try_acquire([Want("c:2")], leases.identity(), 5.0)
    leases.store.cleanup_owner(owner, dead=True, by="reconcile")
    assert leases.store.history(resource="c:2")[0]["by"] == "reconcile"


def test_forced_by_an_operator(make_leases):
    leases = make_leases(history=100)

    def hold_while_forced() -> None:
        with leases.hold("f:1", ttl=5):
            (holder,) = leases.store.holders("f:1")
            assert leases.store.force_release("f:1", holder, by="ops@host")

    with pytest.raises(LeaseLost):
        hold_while_forced()
    forced = leases.store.history(resource="f:1")[0]
    assert (forced["event"], forced["by"]) == ("forced", "ops@host")


def test_fleet_history_merges_slot_groups_and_filters_by_node(make_leases):
    leases = make_leases(history=100, slot_groups=4)
    names = [f"g:{i}" for i in range(12)]
    assert len({leases.store.keys.group_of(n) for n in names}) > 1
    for name in names:
        with leases.hold(name, ttl=5):
            pass
        time.sleep(0.002)  # distinct ms ids, so the order is the grant order
    events = leases.store.history(count=100)
    assert len(events) == 24
    granted = [e["resource"] for e in events if e["event"] == "granted"]
    assert granted == names[::-1]
    assert [e["at"] for e in events] == sorted((e["at"] for e in events), reverse=True)
    assert len(leases.store.history(count=5)) == 5
    node = leases.identity().node
    assert len(leases.store.history(node=node, count=100)) == 24
    assert leases.store.history(node="nobody@nowhere") == []


def test_the_stream_is_capped(make_leases, leases_redis):
    leases = make_leases(history=10)
    for _ in range(300):
        with leases.hold("cap", ttl=5):
            pass
    key = leases.store.keys.history(0)
    assert leases_redis.xlen(key) < 300  # MAXLEN ~ trims whole nodes (about 100 entries)
    assert leases_redis.pttl(leases.store.keys.resource_history("cap")) > 0


@pytest.mark.asyncio
async def test_the_asyncio_store_reads_the_same_record_and_history(make_leases):
    leases = make_leases(history=100)
    async with leases.ahold("aio:1", ttl=5) as lease:
        record = await leases.astore.lease_record("aio:1")
        assert [h["token"] for h in record["holders"]] == [lease.token]
        assert record["transitions"] == 1
    events = await leases.astore.history(resource="aio:1")
    assert _kinds(events) == ["released", "granted"]
    assert await leases.astore.history(count=1) == events[:1]
