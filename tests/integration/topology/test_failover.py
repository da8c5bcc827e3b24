"""A Sentinel failover while leases are held: a real master killed with SIGKILL, a replica
promoted by real sentinels.

- With ``min_replicas=1`` every grant and renewal is on the replica before it counts, so the
  holders keep their leases through the failover, nobody else gets them, and fencing tokens go
  on growing.
- Without it, a grant the replica never saw is gone after the failover: its holder is told
  (``LeaseLost``) and the next holder's token is still larger (tokens are at least the Redis
  clock in microseconds).
- With ``min_replicas=1`` and the replica unable to confirm, the grant is refused and given back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis

from celery_leases import LeaseBusy, LeaseLost
from celery_leases._lease import Want
from celery_leases._redis_server import free_port
from celery_leases.exceptions import LeaseBackendError
from tests.support.polling import wait_until
from tests.support.topologies import leases_factory
from tests.support.topology import LocalSentinel

RESOURCES = ["fo:a", "fo:b", "fo:c"]


@pytest.fixture
def sentinel(request: pytest.FixtureRequest) -> Iterator[LocalSentinel]:
    """A Sentinel set of this test's own (the test kills its master); one replica, or
    ``@pytest.mark.parametrize("sentinel", [n], indirect=True)`` replicas."""
    replicas = getattr(request, "param", 1)
    with LocalSentinel(replicas=replicas, sentinels=3) as s:
        yield s


@pytest.fixture
def make(sentinel: LocalSentinel) -> Iterator[Any]:
    with leases_factory(sentinel.url, f"fo-{uuid.uuid4().hex[:8]}") as make_leases:
        yield make_leases


def fail_over(sentinel: LocalSentinel) -> int:
    """SIGKILL the master; return the new master's port once every sentinel names it."""
    old = sentinel.master()
    old.kill()
    return sentinel.wait_for_new_master(old.port, timeout=60).port


# two replicas: after the failover the new master still has one to confirm renewals to
@pytest.mark.parametrize("sentinel", [2], indirect=True)
def test_held_leases_survive_a_failover_with_min_replicas(sentinel, make) -> None:
    holder = make(node="holder", ttl=10.0, min_replicas=1)
    rival = make(node="rival", ttl=10.0)
    old_port = sentinel.master_port()
    with ExitStack() as stack:
        held = [stack.enter_context(holder.hold(r)) for r in RESOURCES]
        before = {h.resource: h.token for h in held}

        new_port = fail_over(sentinel)

        assert new_port != old_port
        # the holder's heartbeat reaches the new master: the grants were there already
        wait_until(
            lambda: all(
                [x.owner for x in holder.store.holders(r)] == [holder.identity().owner]
                for r in RESOURCES
            ),
            30,
            "the new master has every lease",
        )
        renewed = holder.store.renew([h._held for h in held], holder.identity().owner, timeout=5.0)
        assert renewed == set(), "a renewal on the new master found a lease missing"
        for h in held:
            h.check()
        for r in RESOURCES:
            with pytest.raises(LeaseBusy):
                rival.acquire([Want(r)])
    # released on the new master; the next grants have larger tokens. They wait out the
    # new master's restore_grace (ttl): a failover is recognised, and Redis cannot know that
    # nothing was lost
    for r in RESOURCES:
        with rival.hold(r, wait=30) as again:
            assert again.token > before[r]


def test_without_replication_a_lost_grant_is_reported_and_tokens_still_grow(sentinel, make) -> None:
    holder = make(node="holder", ttl=10.0)  # min_replicas=0: asynchronous replication
    rival = make(node="rival", ttl=10.0)
    master = sentinel.master()
    replica = next(s for s in sentinel.data if s is not master)
    unseen: Any = None
    with pytest.raises(LeaseLost) as info, holder.hold("fo:solo") as lease:  # noqa: PT012
        wait_until(lambda: _in_sync(master), 10, "the replica has fo:solo")
        # cut the replica off (as a partition would) so it misses the next grant
        replica_client = redis.Redis.from_url(replica.url)
        replica_client.replicaof("127.0.0.1", str(free_port()))
        replica_client.close()
        with holder.hold("fo:unseen") as unseen:
            master.kill()
            sentinel.wait_for_new_master(master.port, timeout=60)
            # the replica had "fo:solo" (granted while it listened) but not "fo:unseen"
            wait_until(lambda: unseen.lost, 30, "the holder is told its lease is gone")
            lease.check()
            with rival.hold("fo:unseen", wait=30) as taken:  # after the restore_grace
                assert taken.token > unseen.token
            with pytest.raises(LeaseBusy):
                rival.acquire([Want("fo:solo")])
    assert info.value.resource == "fo:unseen"  # leaving the block says so too


def _in_sync(master: Any) -> bool:
    client = redis.Redis.from_url(master.url, decode_responses=True)
    try:
        info = client.info("replication")
    finally:
        client.close()
    offset = int(info["master_repl_offset"])
    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return bool(replicas) and all(int(v["offset"]) >= offset for v in replicas)


def test_min_replicas_refuses_and_gives_back_a_grant_no_replica_confirms(sentinel, make):
    leases = make(node="holder", ttl=10.0, min_replicas=1, min_replicas_timeout=0.3)
    replica = next(s for s in sentinel.data if s is not sentinel.master())
    replica.pause()
    try:
        with pytest.raises(LeaseBackendError, match="replicas"):
            leases.acquire([Want("fo:refused")])
        assert leases.store.holders("fo:refused") == []
        assert leases.store.entries(leases.identity().owner) == []
    finally:
        replica.resume()
    with leases.hold("fo:refused") as lease:  # with the replica back, granted
        lease.check()


@pytest.mark.asyncio
async def test_the_asyncio_api_waits_for_replicas_too(redis_sentinel) -> None:
    with leases_factory(redis_sentinel.url, f"fo-a-{uuid.uuid4().hex[:8]}") as make_leases:
        leases = make_leases(ttl=1.0, min_replicas=1, min_replicas_timeout=0.3)
        try:
            async with leases.ahold("fo:async", ttl=1.0) as lease:
                await asyncio.sleep(1.5)  # renewed past its ttl, each renewal confirmed
                lease.check()
            replica = next(s for s in redis_sentinel.data if s is not redis_sentinel.master())
            replica.pause()
            try:
                with pytest.raises(LeaseBackendError, match="replicas"):
                    async with leases.ahold("fo:async-refused"):
                        pass
                assert leases.store.holders("fo:async-refused") == []
            finally:
                replica.resume()
        finally:
            await leases.aclose()
