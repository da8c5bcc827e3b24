"""The documented ACL user (docs/redis.md, with its cluster line) is enough on a Redis Cluster."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from celery import Celery
from redis.exceptions import NoPermissionError

from celery_leases import Leases, Shared
from celery_leases._identity import Identity
from celery_leases._lease import Want
from tests.support.acl import create_documented_user
from tests.support.topologies import CLUSTER_SLOT_GROUPS


def test_the_documented_user_works_on_every_node(redis_cluster) -> None:
    user = f"leases-acl-{uuid.uuid4().hex[:6]}"
    password = uuid.uuid4().hex
    for server in redis_cluster.servers:
        admin = redis.Redis.from_url(server.url)
        try:
            create_documented_user(admin, password=password, cluster=True, user=user)
        finally:
            admin.close()
    seeds = redis_cluster.url.removeprefix("redis+cluster://")
    url = f"redis+cluster://{user}:{password}@{seeds}"
    leases = Leases(
        Celery("acl-cluster", set_as_current=False),
        redis_url=url,
        key_prefix="leases",  # the documented key pattern is {leases:*
        slot_groups=CLUSTER_SLOT_GROUPS,
        ttl=0.6,
    )
    try:
        tag = uuid.uuid4().hex[:6]
        with leases.hold([f"a:{tag}", f"b:{tag}", Shared(f"c:{tag}", limit=2)]) as held:
            time.sleep(1.0)  # renewed past its ttl on every node
            for lease in held:
                lease.check()
        assert leases.once(f"init:{tag}", lambda: {"ok": 1}) == {"ok": 1}
        assert leases.forget(f"init:{tag}")
        dead = Identity(f"dead-{tag}", "inc", 1)
        assert isinstance(leases.store.try_acquire([Want(f"d:{tag}")], dead, 30.0), list)
        report = leases.store.cleanup_owner(dead.owner, dead=True)
        assert [r for _, r in report.released] == [f"d:{tag}"]
        assert leases.store.owners()
        with pytest.raises(NoPermissionError):
            leases.store.client.get("outside:key")
    finally:
        leases.store.close()
        for server in redis_cluster.servers:
            admin = redis.Redis.from_url(server.url)
            try:
                admin.acl_deluser(user)
            finally:
                admin.close()
