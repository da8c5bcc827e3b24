"""One rule for every path that grants: a grant refreshes its owner's liveness to at least the
grant's horizon, so no reconcile frees a lease its holder still counts held.

Each test registers an owner at t0, grants through one path near the end of that liveness
window (t0 + 0.8 ttl, where an earlier rule for unique takeovers still counted the owner fresh),
runs a reconcile after t0 + ttl, and checks that the lease is still in Redis whenever its holder
still counts it held. The takeover path failed this before the rule was written once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_leases._aio.driver import AsyncLeaseStore
from celery_leases._claims import Claimed
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._sync.driver import LeaseStore
from tests.support.polling import wait_until

TTL = 2.0  # the ttl setting: the owner's liveness; every lease here has this ttl too
OWNER = Identity("worker-a@host", "inca", 101)


def _store(make_leases_store: Callable[..., LeaseStore]) -> LeaseStore:
    return make_leases_store(ttl=TTL, slot_groups=4, reconcile_interval=0)


def _register_at_t0(store: LeaseStore) -> float:
    """Register OWNER (a grant in the home group, released at once); returns t0."""
    t0 = time.monotonic()
    got = store.try_acquire([Want("warm-up")], OWNER, TTL)
    assert isinstance(got, list)
    store.release(got)
    return t0


def _until(moment: float) -> None:
    wait_until(lambda: time.monotonic() >= moment, TTL * 3, "the moment", step=0.01)


def _names(store: LeaseStore, groups: Callable[[int], bool], count: int) -> list[str]:
    """``count`` resource names, each in another slot group that ``groups`` accepts."""
    seen: dict[int, str] = {}
    i = 0
    while len(seen) < count:
        name = f"res:{i}"
        if groups(store.keys.group_of(name)):
            seen.setdefault(store.keys.group_of(name), name)
        i += 1
    return list(seen.values())


def _check_after_reconcile(store: LeaseStore, t0: float, held: Held) -> None:
    # past the liveness the owner had at t0: a reconcile would find it run out unless the grant
    # refreshed it
    _until(t0 + TTL * 1.05)
    store.reconcile()
    holders = store.holders(held.resource)
    if time.monotonic() < held.deadline:  # the holder still counts it held
        assert [(h.owner, h.token) for h in holders] == [(OWNER.owner, held.token)], (
            "a reconcile freed a lease whose holder still counts it held"
        )


def _grant_home_group(store: LeaseStore) -> Held:
    (name,) = _names(store, lambda group: group == 0, 1)
    got = store.try_acquire([Want(name)], OWNER, TTL)
    assert isinstance(got, list)
    return got[0]


def _grant_other_group(store: LeaseStore) -> Held:
    (name,) = _names(store, lambda group: group != 0, 1)
    got = store.try_acquire([Want(name)], OWNER, TTL)
    assert isinstance(got, list)
    return got[0]


def _grant_set(store: LeaseStore) -> Held:
    names = _names(store, lambda group: True, 3)
    got = store.try_acquire([Want(n) for n in names], OWNER, TTL)
    assert isinstance(got, list)
    return got[-1]


def _take_over_unique_claim(store: LeaseStore) -> Held:
    claimed = store.unique_claim("report:42", "task-1", 60)
    assert isinstance(claimed, Claimed)
    got = store.unique_handover("report:42", "task-1", OWNER, TTL)
    assert isinstance(got, Held)
    return got


@pytest.mark.parametrize(
    "grant",
    [_grant_home_group, _grant_other_group, _grant_set, _take_over_unique_claim],
    ids=["home-group", "other-group", "set-over-groups", "unique-takeover"],
)
def test_a_grant_near_the_end_of_the_liveness_window_survives_a_reconcile(
    make_leases_store: Callable[..., LeaseStore], grant: Callable[[LeaseStore], Held]
) -> None:
    store = _store(make_leases_store)
    t0 = _register_at_t0(store)
    _until(t0 + TTL * 0.8)

    held = grant(store)

    _check_after_reconcile(store, t0, held)


def test_an_asyncio_grant_near_the_end_of_the_liveness_window_survives_a_reconcile(
    make_leases_store: Callable[..., LeaseStore],
) -> None:
    store = _store(make_leases_store)
    t0 = _register_at_t0(store)
    _until(t0 + TTL * 0.8)

    async def grant() -> Any:
        astore = AsyncLeaseStore(store.settings, engine=store.engine)
        try:
            (name,) = _names(store, lambda group: group != 0, 1)
            return await astore.try_acquire([Want(name)], OWNER, TTL)
        finally:
            await astore.aclose()

    got = asyncio.run(grant())
    assert isinstance(got, list)

    _check_after_reconcile(store, t0, got[0])
