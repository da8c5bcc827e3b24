"""Unique claims on a real Redis Cluster and behind real sentinels: same as on one server.

With several slot groups, claims spread over the cluster's primaries; each script touches
one hash slot, so each runs unchanged (a cross-slot script would fail with CROSSSLOT).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from celery_leases import Leases
from celery_leases._claims import Claimed, ClaimHolder, ClaimMode
from celery_leases._identity import Identity
from celery_leases._lease import Held
from celery_leases._modes import kept
from celery_leases._parking import unpark
from tests.support.topologies import Topology, leases_factory

WORKER = Identity("topo-worker@host", "inc", 4242)


@pytest.fixture
def make(topology: Topology) -> Iterator[Callable[..., Leases]]:
    with leases_factory(
        topology.url, f"topo-u-{uuid.uuid4().hex[:8]}", **topology.settings
    ) as make_leases:
        yield make_leases


def test_claims_in_every_slot_group(make: Callable[..., Leases]) -> None:
    leases = make()
    store = leases.store
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < store.settings.slot_groups:
        key = f"job:{i}"
        keys.setdefault(store.resource_keys(store.keys.unique_resource(key)).group, key)
        i += 1
    for key in keys.values():
        claimed = store.unique_claim(key, f"t-{key}", 30)
        assert isinstance(claimed, Claimed)
        refused = store.unique_claim(key, "other", 30)
        assert isinstance(refused, ClaimHolder)
        assert refused.task_id == f"t-{key}"
    assert sorted(c.key for c in store.queued_claims()) == sorted(keys.values())
    for key in keys.values():
        held = store.unique_handover(key, f"t-{key}", WORKER, 30)
        assert isinstance(held, Held)
        running = store.unique_claim(key, "other", 30)
        assert isinstance(running, ClaimHolder)
        assert (running.state, running.task_id) == ("running", f"t-{key}")
        # on_duplicate="cancel": the revocation mark and the park, in the claim's one slot
        cancel = kept(ClaimMode(cancel=20.0, reason="topology"), key, "topo.task", (), {}, {})
        follows = store.unique_claim(key, "canceller", 30, cancel)
        assert isinstance(follows, Claimed)
        assert (follows.follows, follows.cancels) == ("canceller", f"{held.token} {WORKER.owner}")
        mark = store.client.get(store.keys.revocation(held.resource))
        assert mark is not None
        assert [str(w) for w in mark.split()[1:]] == [str(held.token), "topology"]
        assert unpark(leases, "canceller")
        assert store.unique_requeue(held, 30)
        again = store.unique_take(key, f"t-{key}", WORKER, 30, wait=1)
        assert isinstance(again, Held)
        assert store.release([again]) == [True]
        assert store.unique_holder(key) is None
        store.unique_claim(key, "last", 30)
        assert store.unique_unclaim(key, "last")
    assert store.queued_claims() == []
    report = store.cleanup_owner(WORKER.owner, dead=True)
    assert report.errors == []
