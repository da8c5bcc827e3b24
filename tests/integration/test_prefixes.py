"""Two key prefixes on one Redis are two separate worlds."""

from __future__ import annotations

import time

import pytest

from celery_leases import LeaseBusy, Shared
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import Want


@pytest.fixture(params=[":0", "-b", ":1"])
def pair(request, make_leases, leases_prefix):
    # ":0" is the trap: prefix "p" group 0 and prefix "p:0" must not share a hash tag
    a = make_leases(key_prefix=leases_prefix, node="node-a")
    b = make_leases(key_prefix=leases_prefix + request.param, node="node-b")
    return a, b


def test_the_same_resource_is_held_in_both_at_once(pair):
    a, b = pair
    with a.hold("r") as la, b.hold("r") as lb:
        assert [h.owner for h in a.store.holders("r")] == [a.identity().owner]
        assert [h.owner for h in b.store.holders("r")] == [b.identity().owner]
        assert la.token > 0
        assert lb.token > 0
        with pytest.raises(LeaseBusy), a.hold("r"):
            pass
        with pytest.raises(LeaseBusy), b.hold(Shared("r")):
            pass


def test_owners_nodes_and_registries_stay_apart(pair):
    a, b = pair
    with a.hold(["r", Shared("s")]), b.hold("t"):
        assert [o for o, _ in a.store.owners()] == [a.identity().owner]
        assert [o for o, _ in b.store.owners()] == [b.identity().owner]
        assert a.store.nodes() == ["node-a"]
        assert b.store.nodes() == ["node-b"]
        assert [r for _, _, r in a.store.owned(a.identity().owner)] == ["r", "s"]
        assert b.store.owned(a.identity().owner) == []


def test_cleanup_in_one_prefix_leaves_the_other_alone(pair):
    a, b = pair
    ident = Identity("node-x", "old", 1)  # the same owner id in both prefixes
    held_a = a.store.try_acquire([Want("r")], ident, 30.0)
    held_b = b.store.try_acquire([Want("r")], ident, 30.0)
    assert isinstance(held_a, list)
    assert isinstance(held_b, list)

    report = a.store.cleanup_node("node-x")

    assert report.released == [(ident.owner, "r")]
    assert a.store.holders("r") == []
    assert [h.owner for h in b.store.holders("r")] == [ident.owner]
    assert b.store.node_owners("node-x") == [ident.owner]
    # and a release through one prefix's store cannot free the other's lease
    assert a.store.release(held_b) == [False]
    assert isinstance(b.store.try_acquire([Want("r")], Identity("y", "i", 2), 30.0), Busy)
    assert b.store.release(held_b) == [True]


def test_reconcile_in_one_prefix_leaves_the_other_alone(make_leases, leases_prefix):
    a = make_leases(key_prefix=leases_prefix, ttl=0.2)
    b = make_leases(key_prefix=leases_prefix + ":0", ttl=0.2)
    ident = Identity("gone", "inc", 1)
    assert isinstance(a.store.try_acquire([Want("r")], ident, 30.0), list)
    assert isinstance(b.store.try_acquire([Want("r")], ident, 30.0), list)

    # both owners' liveness (settings.ttl = 0.2 s) runs out; only a's reconcile runs
    deadline = time.monotonic() + 5.0
    while not all(ident.owner in s.store.expired_owners() for s in (a, b)):
        assert time.monotonic() < deadline, "the owner's liveness never ran out"
        time.sleep(0.02)
    report = a.store.reconcile()

    assert report.owners == [ident.owner]
    assert a.store.holders("r") == []
    assert [h.owner for h in b.store.holders("r")] == [ident.owner]
    assert [o for o, _ in b.store.owners()] == [ident.owner]
