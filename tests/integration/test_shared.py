"""Shared leases, counting limits, all-or-nothing lists and deadlock-free ordering."""

from __future__ import annotations

import threading

import pytest

from celery_leases import LeaseBusy, Leases, Shared
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._sync.driver import LeaseStore


def other(leases: Leases, name: str = "other") -> Identity:
    """Another owner on the same store (as another process would be)."""
    ident = leases.identity()
    return Identity(name, ident.incarnation, ident.pid)


def test_shared_admits_shared(leases: Leases):
    with leases.hold(Shared("remote")) as a:
        held = leases.store.try_acquire([Want("remote", "s")], other(leases), 5.0)
        assert isinstance(held, list)
        with leases.hold(Shared("remote")) as c:
            assert a.shared
            assert len({a.token, held[0].token, c.token}) == 3
            assert [h.mode for h in leases.store.holders("remote")] == ["s"] * 3
        leases.store.release(held)


def test_shared_refuses_exclusive_and_exclusive_refuses_shared(leases: Leases):
    with leases.hold(Shared("remote")):
        with pytest.raises(LeaseBusy) as info, leases.hold("remote"):
            pass
        assert info.value.resource == "remote"
        busy = leases.store.try_acquire([Want("remote")], other(leases), 5.0)
        assert isinstance(busy, Busy)
    with leases.hold("remote"), pytest.raises(LeaseBusy), leases.hold(Shared("remote")):
        pass
    # once both are gone, either mode is free again
    with leases.hold("remote"):
        pass


def test_exclusive_is_not_reentrant(leases: Leases):
    with leases.hold("only"), pytest.raises(LeaseBusy), leases.hold("only"):
        pass


@pytest.mark.parametrize("limit", [1, 3])
def test_limit_admits_exactly_n(leases: Leases, limit: int):
    store = leases.store
    holders = []
    for n in range(limit):
        got = store.try_acquire([Want("api", "s", limit)], other(leases, f"o{n}"), 5.0)
        assert isinstance(got, list), f"holder {n + 1} of {limit} refused"
        holders += got
    refused = store.try_acquire([Want("api", "s", limit)], other(leases, "extra"), 5.0)
    assert isinstance(refused, Busy)
    assert refused.resource == "api"
    assert 0 < refused.wait <= 5.0
    with pytest.raises(LeaseBusy), leases.hold(Shared("api", limit=limit)):
        pass

    store.release(holders[:1])
    with leases.hold(Shared("api", limit=limit)) as lease:
        assert lease.token > max(h.token for h in holders)
        assert len(store.holders("api")) == limit
    store.release(holders[1:])


def test_limit_counts_only_live_holders(leases: Leases):
    store = leases.store
    first = store.try_acquire([Want("api", "s", 1)], other(leases, "a"), 0.2)
    assert isinstance(first, list)
    busy = store.try_acquire([Want("api", "s", 1)], other(leases, "b"), 5.0)
    assert isinstance(busy, Busy)
    # no release: the first holder's expiry (told in busy.wait) frees the slot
    got = store.acquire([Want("api", "s", 1)], other(leases, "b"), 5.0, wait=5 * 0.2)
    assert len(got) == 1
    store.release(got)


def resource_keys(store: LeaseStore, name: str) -> list[str]:
    return list(store.keys.resource_keys(name))


@pytest.mark.parametrize("busy_mode", ["x", "s"])
def test_a_busy_member_grants_none_and_leaves_no_keys(leases: Leases, leases_redis, busy_mode: str):
    store = leases.store
    blocker = store.try_acquire([Want("b", busy_mode)], other(leases), 5.0)
    assert isinstance(blocker, list)
    registry = store.keys.registry(leases.identity().owner, 0)
    before = leases_redis.smembers(registry)

    # "b" is asked for exclusively: busy whether its holder is exclusive or shared
    wanted: list[str | Shared] = ["a", "b", Shared("c"), "d"]
    with pytest.raises(LeaseBusy) as info, leases.hold(wanted):
        pass

    assert info.value.resource == "b"
    for name in ("a", "c", "d"):
        assert store.holders(name) == []
        assert leases_redis.exists(*resource_keys(store, name)) == 0, name
    assert leases_redis.smembers(registry) == before
    store.release(blocker)


def test_all_or_nothing_across_slot_groups(make_leases, leases_redis):
    leases = make_leases(slot_groups=16)
    store = leases.store
    names = [f"res-{i}" for i in range(12)]
    groups = {store.keys.group_of(n) for n in names}
    assert len(groups) > 3
    # block the member of the highest group, so every lower group is granted first
    last = max(names, key=store.keys.group_of)
    blocker = store.try_acquire([Want(last)], other(leases), 5.0)
    assert isinstance(blocker, list)

    with pytest.raises(LeaseBusy) as info, leases.hold(names):
        pass

    assert info.value.resource == last
    owner = leases.identity().owner
    for name in names:
        if name != last:
            assert store.holders(name) == []
            xkey, skey, _ = resource_keys(store, name)
            assert leases_redis.exists(xkey, skey) == 0, name
    for group in groups:  # no entry left (its keeper "~" may stay: see lua/_registry.lua)
        assert leases_redis.smembers(store.keys.registry(owner, group)) <= {"~"}
    store.release(blocker)


def test_a_list_yields_leases_in_the_order_given(leases: Leases):
    wanted = ["z", Shared("a"), "m"]
    with leases.hold(wanted) as got:
        assert [lease.resource for lease in got] == ["z", "a", "m"]
        assert [lease.shared for lease in got] == [False, True, False]


def test_a_list_with_the_same_name_twice_is_refused(leases: Leases):
    with pytest.raises(ValueError, match="twice"), leases.hold(["a", Shared("a")]):
        pass


@pytest.mark.parametrize("slot_groups", [1, 16])
def test_opposite_orders_never_deadlock(make_leases, slot_groups: int):
    leases = make_leases(slot_groups=slot_groups)
    a, b = "alpha", "beta"
    if slot_groups > 1:
        a, b = next(
            (f"alpha{i}", f"beta{i}")
            for i in range(100)
            if leases.store.keys.group_of(f"alpha{i}") != leases.store.keys.group_of(f"beta{i}")
        )
    rounds = 40
    start = threading.Barrier(2)
    done: list[int] = []
    errors: list[BaseException] = []
    inside = threading.Lock()

    def worker(order: list[str]) -> None:
        try:
            start.wait(timeout=30)
            for _ in range(rounds):
                with leases.hold(order, ttl=5, wait=20) as got:
                    assert [g.resource for g in got] == order
                    assert inside.acquire(blocking=False), "both held the pair at once"
                    inside.release()
            done.append(1)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=([a, b],)),
        threading.Thread(target=worker, args=([b, a],)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread never finished"
    assert errors == []
    assert len(done) == 2


def test_tokens_grow_with_every_grant_shared_ones_included(leases: Leases):
    store = leases.store
    tokens = []
    held = []
    for n in range(5):  # shared grants, each to its own owner, all held at once
        got = store.try_acquire([Want("res", "s")], other(leases, f"s{n}"), 5.0)
        assert isinstance(got, list)
        tokens.append(got[0].token)
        held += got
    store.release(held)
    for _ in range(3):  # then exclusive and shared grants, one after another
        with leases.hold("res") as x:
            tokens.append(x.token)
        with leases.hold(Shared("res")) as s:
            tokens.append(s.token)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)
