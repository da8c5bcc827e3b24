"""Reconcile on a Redis Cluster: tokens of each slot group are compared with an owner's
liveness on the clock of the node that made them, never larger than the true offset."""

from __future__ import annotations

from collections.abc import Callable

from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._sync.driver import LeaseStore
from tests.support.topology import LocalCluster

OWNER = Identity("worker-a@host", "inca", 101)


def _in_group(store: LeaseStore, group: int) -> str:
    return next(f"res:{i}" for i in range(10_000) if store.keys.group_of(f"res:{i}") == group)


def test_clock_offsets_are_read_per_group_node(
    redis_cluster: LocalCluster, make_leases_store: Callable[..., LeaseStore]
) -> None:
    store = make_leases_store(redis_url=redis_cluster.url, slot_groups=16)

    now_us, offsets = store.clocks_us()

    assert now_us > 0
    assert offsets is not None
    assert len(offsets) == 16
    assert offsets[0] == 0
    # the nodes share this machine's clock: each offset is the (negative) length of the read
    assert all(-1_000_000 < off <= 0 for off in offsets)


def test_one_server_has_one_clock(make_leases_store: Callable[..., LeaseStore]) -> None:
    now_us, offsets = make_leases_store(slot_groups=4).clocks_us()
    assert now_us > 0
    assert offsets is None


def test_a_cleanup_shifts_the_cut_of_each_group_by_its_clock_offset(
    redis_cluster: LocalCluster, make_leases_store: Callable[..., LeaseStore]
) -> None:
    store = make_leases_store(redis_url=redis_cluster.url, slot_groups=4)
    names = [_in_group(store, group) for group in range(4)]
    got = store.try_acquire([Want(n) for n in names], OWNER, 30)
    assert isinstance(got, list)
    cut = max(h.token for h in got) + 1  # every grant was made before it, by one clock
    late = got[2]
    # the node of group 2 runs 1 s behind the home node: its lease's token, read on the home
    # node's clock, was made after the cut, by an owner that was alive again
    offsets = [0, 0, -1_000_000, 0]

    report = store.cleanup_owner(OWNER.owner, granted_before_us=cut, clock_offsets_us=offsets)

    assert sorted(r for _, r in report.released) == sorted(n for n in names if n != late.resource)
    assert [h.token for h in store.holders(late.resource)] == [late.token]
