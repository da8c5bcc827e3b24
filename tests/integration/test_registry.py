"""The owner registry: what it records per grant, and entries it cannot read."""

from __future__ import annotations

import pytest

from celery_leases import LeaseBusy, Leases
from celery_leases._lease import Want
from tests.support.lifetimes import mark_up


def test_registry_records_mode_token_task_and_resource(leases: Leases):
    owner = leases.identity().owner
    (lease,) = leases.acquire([Want("a b:{c}")], task_id="task 1/é")
    try:
        (entry,) = leases.store.entries(owner)
        assert entry.mode == "x"
        assert entry.token == lease.token
        assert entry.task_id == "task 1/é"
        assert entry.resource == "a b:{c}"
    finally:
        leases.release([lease])
    assert leases.store.entries(owner) == []


def test_unreadable_entries_are_kept_and_reported(leases: Leases, leases_redis):
    store = leases.store
    owner = leases.identity().owner
    (lease,) = leases.acquire([Want("r")])
    leases.release([])  # nothing
    registry = store.keys.registry(owner, 0)
    leases_redis.sadd(registry, "garbage entry", "x notanumber - r2")

    report = store.cleanup_owner(owner, dead=True)

    assert report.released == [(owner, "r")]
    assert sorted(entry for _, entry in report.kept) == ["garbage entry", "x notanumber - r2"]
    # with what it keeps, the registry keeps its keeper "~" too (see lua/_registry.lua)
    assert leases_redis.smembers(registry) == {"garbage entry", "x notanumber - r2", "~"}
    # kept entries keep the owner registered, so a later pass can look again
    assert owner in store.node_owners(leases.identity().node)
    assert store.holders("r") == []
    leases.release([lease])  # already freed by the cleanup: nothing left to do
    leases_redis.delete(registry)


def test_a_shorter_liveness_never_cuts_a_longer_one(make_leases, leases_prefix):
    # two Leases on one prefix in one process share the owner id; the one with the shorter
    # ttl setting must not make the owner look dead sooner than the longer one promised
    long_lived = make_leases(ttl=60.0)
    short_lived = make_leases(ttl=2.0)
    owner = long_lived.identity().owner
    assert short_lived.identity().owner == owner
    with long_lived.hold("long"), short_lived.hold("short"):
        left = dict(long_lived.store.owners())[owner]
        assert left > 30.0, f"liveness was cut to {left:.1f}s"


def test_a_grant_outside_the_home_group_is_given_back_when_the_home_call_is_refused(
    make_leases, leases_redis
):
    # the home call and the grant go in one round trip; the home group still in its restart
    # grace refuses the owner, so the grant that went through in the other group is given back
    leases = make_leases(slot_groups=8, restart_grace=30.0)
    store = leases.store
    name = next(f"r{i}" for i in range(100) if store.keys.group_of(f"r{i}") != 0)
    mark_up(leases_redis, store.keys.lifetime(store.keys.group_of(name)))
    with pytest.raises(LeaseBusy) as busy:
        leases.acquire([Want(name)])
    assert busy.value.resource == "(owner registration)"
    assert store.holders(name) == []
    assert store.entries(leases.identity().owner) == []


def test_a_registry_outlives_the_release_of_its_last_entry(leases: Leases, leases_redis):
    # t0 a grant sets the registry's expiry; t1 its release takes the last entry. Without its
    # keeper "~" the set went then, with its expiry, and t2 the next grant made it anew without
    # one while the process still counted on the expiry of t0: a crash then left it for good
    registry = leases.store.keys.registry(leases.identity().owner, 0)
    with leases.hold("first"):
        first = leases_redis.pttl(registry)
    assert first > 0
    assert leases_redis.smembers(registry) == {"~"}
    assert 0 < leases_redis.pttl(registry) <= first
    with leases.hold("second"):
        again = leases_redis.pttl(registry)
    assert 0 < again <= first


def test_a_registry_made_anew_by_a_grant_gets_an_expiry(leases: Leases, leases_redis):
    # the registry went while the process counts on its expiry (a cleanup that took every
    # member, an operator): the next grant's SADD finds no keeper, and sets the expiry
    registry = leases.store.keys.registry(leases.identity().owner, 0)
    with leases.hold("first"):
        pass
    leases_redis.delete(registry)
    with leases.hold("second"):
        again = leases_redis.pttl(registry)
    assert again > 0, f"the registry made anew has no expiry (PTTL {again})"


def test_a_registry_that_lives_on_keeps_its_expiry(leases: Leases, leases_redis):
    # the expiry is set once while enough of it is left: later grants leave it alone
    registry = leases.store.keys.registry(leases.identity().owner, 0)
    with leases.hold("kept"):
        leases_redis.pexpire(registry, 10**9)
        with leases.hold("beside"):
            assert leases_redis.pttl(registry) > 10**9 - 60_000


def test_the_cleanup_of_a_dead_owner_removes_its_registry(make_leases, leases_redis):
    leases = make_leases()
    owner = leases.identity().owner
    registry = leases.store.keys.registry(owner, 0)
    (lease,) = leases.acquire([Want("r")])
    report = leases.store.cleanup_owner(owner, dead=True)
    assert report.released == [(owner, "r")]
    assert report.kept == []  # the keeper "~" is no entry
    assert not leases_redis.exists(registry)
    leases.release([lease])  # freed by the cleanup already: nothing left to do
