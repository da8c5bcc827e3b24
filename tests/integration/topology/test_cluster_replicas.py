"""``min_replicas`` on a real Redis Cluster with one replica per primary.

Each grant and each renewal waits (``WAIT``) for the replicas of the primary that serves its
slot group, on the connection that made the write:

- grants and renewals spread over the three primaries (16 slot groups) are on each primary's
  replica as soon as they count;
- with one replica frozen (SIGSTOP), a grant in its primary's slots is refused with
  ``LeaseBackendError`` and given back, while the other primaries go on granting; a renewal
  there fails, and the holder is told its lease is lost;
- the asyncio API does the same (its own plain client per node, as a ``WAIT`` has no key), and
  after a ``MOVED`` reply it reads the slot map again, so the next attempt reaches the right
  node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_leases import LeaseLost, Leases
from celery_leases._lease import Held, Want
from celery_leases._redis_server import RedisServer
from celery_leases.exceptions import LeaseBackendError
from tests.support.polling import wait_until
from tests.support.topologies import (
    CLUSTER_SLOT_GROUPS,
    leases_factory,
    resources_in_distinct_groups,
)
from tests.support.topology import LocalCluster

#: a grant's TTL here, and the longer one a renewal gives it (told apart on the replica)
GRANT_TTL = 600.0
RENEWED_TTL = 3600.0


@pytest.fixture(scope="module")
def replicas(redis_cluster_replicated: LocalCluster) -> dict[int, RedisServer]:
    """Primary port -> its replica, once every replica is in sync with its primary."""

    def linked() -> dict[int, RedisServer] | None:
        out: dict[int, RedisServer] = {}
        for server in redis_cluster_replicated.servers:
            info = _info(server)
            if info["role"] == "slave":
                if info.get("master_link_status") != "up":
                    return None
                out[int(info["master_port"])] = server
        return out if len(out) == 3 else None

    found: dict[int, RedisServer] = wait_until(linked, 30, "every replica linked")
    return found


@pytest.fixture
def make(redis_cluster_replicated: LocalCluster) -> Iterator[Callable[..., Leases]]:
    with leases_factory(
        redis_cluster_replicated.url,
        f"rep-{uuid.uuid4().hex[:8]}",
        slot_groups=CLUSTER_SLOT_GROUPS,
        min_replicas=1,
        min_replicas_timeout=0.3,
    ) as make_leases:
        yield make_leases


def _info(server: RedisServer) -> dict[str, Any]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        return client.info("replication")
    finally:
        client.close()


def primary_port(leases: Leases, key: str) -> int:
    """The port of the primary that serves ``key``."""
    node = leases.store.client.get_node_from_key(key)  # type: ignore[attr-defined]
    return int(node.port)


def xkey(leases: Leases, resource: str) -> str:
    return leases.store.resource_keys(resource).exclusive


def on_replica(replica: RedisServer, key: str) -> tuple[str | None, int]:
    """``key``'s value and PTTL as ``replica`` has them (read with READONLY)."""
    client = redis.Redis.from_url(replica.url, decode_responses=True, single_connection_client=True)
    try:
        client.execute_command("READONLY")
        return client.get(key), int(client.pttl(key))
    finally:
        client.close()


def every_group(leases: Leases) -> list[str]:
    """One resource name per slot group (so every primary serves some of them), in group
    order."""
    names = resources_in_distinct_groups(leases, CLUSTER_SLOT_GROUPS)
    return sorted(names, key=leases.store.keys.group_of)


def pick(leases: Leases, replicas: dict[int, RedisServer]) -> tuple[RedisServer, str, str]:
    """A replica to freeze, a resource its primary serves, and one another primary serves.

    The frozen replica's primary is not group 0's, which holds each owner's home keys (a
    grant of a new owner registers there first).
    """
    home = primary_port(leases, leases.store.keys.epoch(0))
    names = every_group(leases)
    frozen = next(port for port in sorted(replicas) if port != home)
    there = next(n for n in names if primary_port(leases, xkey(leases, n)) == frozen)
    elsewhere = next(n for n in names if primary_port(leases, xkey(leases, n)) != frozen)
    return replicas[frozen], there, elsewhere


def assert_on_replicas(
    leases: Leases, replicas: dict[int, RedisServer], held: list[Held], min_pttl: float
) -> None:
    """Each of ``held`` is on its primary's replica, with its token and a PTTL over ``min_pttl``."""
    owner = leases.identity().owner
    for h in held:
        key = xkey(leases, h.resource)
        value, pttl = on_replica(replicas[primary_port(leases, key)], key)
        assert value == f"{h.token} {owner}", h.resource
        assert pttl > min_pttl * 1000, h.resource


def longer(held: list[Held]) -> list[Held]:
    """Copies of ``held`` that a renewal extends to RENEWED_TTL."""
    return [dataclasses.replace(h, ttl=RENEWED_TTL) for h in held]


async def poll(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """:func:`wait_until` for a coroutine: the event loop (and its heartbeat) runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


# --- sync -------------------------------------------------------------------------------------
def test_grants_and_renewals_are_on_the_replicas_of_every_primary(make, replicas) -> None:
    leases = make(ttl=GRANT_TTL)
    names = every_group(leases)
    assert {primary_port(leases, xkey(leases, n)) for n in names} == set(replicas)
    with leases.hold(names) as held:
        grants = [lease._held for lease in held]
        assert_on_replicas(leases, replicas, grants, min_pttl=0)
        owner = leases.identity().owner
        assert leases.store.renew(longer(grants), owner, timeout=5.0) == set()
        # a renewal to RENEWED_TTL, so a PTTL over GRANT_TTL is the renewal's
        assert_on_replicas(leases, replicas, grants, min_pttl=GRANT_TTL)


def test_a_grant_its_replica_cannot_confirm_is_refused_and_given_back(make, replicas) -> None:
    leases = make(ttl=GRANT_TTL)
    replica, there, elsewhere = pick(leases, replicas)
    owner = leases.identity().owner
    replica.pause()
    try:
        with pytest.raises(LeaseBackendError, match="replicas"):
            leases.acquire([Want(there)])
        assert leases.store.holders(there) == []
        assert leases.store.entries(owner) == []
        with leases.hold(elsewhere) as lease:  # another primary's replica confirms
            lease.check()
    finally:
        replica.resume()
    with leases.hold(there) as lease:  # with the replica back, granted
        assert_on_replicas(leases, replicas, [lease._held], min_pttl=0)


def test_a_renewal_its_replica_cannot_confirm_fails_and_the_lease_is_lost(make, replicas) -> None:
    leases = make(ttl=2.0)
    replica, there, _ = pick(leases, replicas)
    owner = leases.identity().owner
    with pytest.raises(LeaseLost) as info, leases.hold(there) as lease:  # noqa: PT012
        replica.pause()
        try:
            with pytest.raises(LeaseBackendError, match="replicas"):
                leases.store.renew([lease._held], owner, timeout=5.0)
            # the heartbeat's renewals fail the same way until the lease's deadline passes
            wait_until(lambda: lease.lost, 30, "the holder is told its lease is lost")
        finally:
            replica.resume()
    assert info.value.resource == there


# --- asyncio ----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_asyncio_grants_and_renewals_are_on_the_replicas_of_every_primary(
    make, replicas
) -> None:
    leases = make(ttl=GRANT_TTL)
    names = every_group(leases)
    try:
        held = await leases.aacquire([Want(n) for n in names])
        grants = [lease._held for lease in held]
        try:
            assert_on_replicas(leases, replicas, grants, min_pttl=0)
            owner = leases.identity().owner
            assert await leases.astore.renew(longer(grants), owner, timeout=5.0) == set()
            assert_on_replicas(leases, replicas, grants, min_pttl=GRANT_TTL)
        finally:
            assert await leases.arelease(held) == []
        # each node's calls went on a plain client of that node: one per primary, per kind
        nodes = leases.astore._state().nodes
        assert {(port, renewal) for _, port, renewal in nodes} == {
            (port, renewal) for port in replicas for renewal in (False, True)
        }
    finally:
        await leases.aclose()


@pytest.mark.asyncio
async def test_asyncio_a_grant_its_replica_cannot_confirm_is_refused_and_given_back(
    make, replicas
) -> None:
    leases = make(ttl=GRANT_TTL)
    replica, there, elsewhere = pick(leases, replicas)
    owner = leases.identity().owner
    try:
        async with leases.ahold(elsewhere):  # the loop's clients know the slot map
            pass
        replica.pause()
        try:
            with pytest.raises(LeaseBackendError, match="replicas"):
                async with leases.ahold(there):
                    pass
            assert leases.store.holders(there) == []
            assert leases.store.entries(owner) == []
            async with leases.ahold(elsewhere) as lease:  # another primary's replica confirms
                lease.check()
        finally:
            replica.resume()
        async with leases.ahold(there) as lease:  # with the replica back, granted
            assert_on_replicas(leases, replicas, [lease._held], min_pttl=0)
    finally:
        await leases.aclose()


@pytest.mark.asyncio
async def test_asyncio_a_renewal_its_replica_cannot_confirm_fails_and_the_lease_is_lost(
    make, replicas
) -> None:
    leases = make(ttl=2.0)
    replica, there, _ = pick(leases, replicas)
    owner = leases.identity().owner
    try:
        with pytest.raises(LeaseLost) as info:  # noqa: PT012
            async with leases.ahold(there) as lease:
                replica.pause()
                try:
                    with pytest.raises(LeaseBackendError, match="replicas"):
                        await leases.astore.renew([lease._held], owner, timeout=5.0)
                    await poll(lambda: lease.lost, 30, "the holder is told its lease is lost")
                finally:
                    replica.resume()
        assert info.value.resource == there
    finally:
        await leases.aclose()


@pytest.mark.asyncio
async def test_asyncio_reads_the_slot_map_again_after_moved(make, replicas) -> None:
    """A slot map gone stale (as after a resharding or a failover): the node client gets
    MOVED, the attempt fails, the map is read again, and the next attempt is granted."""
    leases = make(ttl=GRANT_TTL)
    name = every_group(leases)[0]
    key = xkey(leases, name)
    owner = leases.identity().owner
    try:
        async with leases.ahold(name) as lease:
            assert await leases.astore.renew([lease._held], owner, timeout=5.0) == set()
        manager: Any = leases.astore._state().client.nodes_manager  # type: ignore[attr-defined]
        slot = leases.store.client.keyslot(key)  # type: ignore[attr-defined]
        right = manager.slots_cache[slot][0]
        wrong = next(
            n
            for n in manager.nodes_cache.values()
            if n.server_type == "primary" and n.port != right.port
        )
        manager.slots_cache[slot] = [wrong]  # a real node that does not serve the slot
        with pytest.raises(LeaseBackendError, match="MovedError"):
            await leases.aacquire([Want(name)])
        async with leases.ahold(name) as lease:  # the map was read again
            assert manager.slots_cache[slot][0].port == right.port
            manager.slots_cache[slot] = [wrong]
            with pytest.raises(LeaseBackendError, match="MovedError"):
                await leases.astore.renew([lease._held], owner, timeout=5.0)
            assert manager.slots_cache[slot][0].port == right.port
            assert await leases.astore.renew([lease._held], owner, timeout=5.0) == set()
    finally:
        await leases.aclose()
