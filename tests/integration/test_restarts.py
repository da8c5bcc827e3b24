"""Redis restarts that lose grants: nothing is granted again while a holder still counts it held.

Each test runs on private servers it starts and stops: an RDB snapshot restored, an AOF that
lost its tail, a Sentinel failover to a replica that lagged, a restart without data (covered
by ``restart_grace`` only), and a new Redis (no grace at all with the defaults). In the
restarts that keep data, the grants made after the snapshot (or after the last write the
replica got) are gone while their holder still counts them held until its next renewal;
with the defaults nobody else is granted them before that holder has been told.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_leases import LeaseBusy, LeaseLost, Leases
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._lease import Held
from celery_leases._redis_server import RedisServer
from celery_leases.signals import lease_lost
from tests.integration.test_lost import LostLog, confirmed_once, leave_lost, poll
from tests.support import oldest_redis
from tests.support.acl import USER, create_documented_user
from tests.support.lifetimes import server_identity
from tests.support.polling import wait_until
from tests.support.topology import LocalCluster, LocalSentinel

#: long enough that the holder's first renewal after the restart (every ttl / 3) comes well
#: after the restart itself, so that without the check the second grant would come first
TTL = 3.0


@pytest.fixture
def lost_log() -> Iterator[LostLog]:
    log = LostLog()
    lease_lost.connect(log, weak=False)
    yield log
    lease_lost.disconnect(log)


def oldest_binary() -> str:
    try:
        return str(oldest_redis.binary())
    except oldest_redis.Unavailable as exc:
        pytest.skip(f"no Redis 6.2: {exc}")


def admin(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10)


def aof_file(server: RedisServer) -> Path:
    """The file an AOF server appends to: the INCR file of Redis 7's appendonlydir, or the one
    appendonly.aof of Redis 6.2."""
    folder = Path(server.dir) / "appendonlydir"
    if folder.is_dir():
        (incr,) = [p for p in folder.iterdir() if p.name.endswith(".incr.aof")]
        return incr
    return Path(server.dir) / "appendonly.aof"


def check_after_restart(
    holder: Leases,
    second: Leases,
    lost_log: LostLog,
    stack: ExitStack,
    kept: Any,
    gone: Any,
    *,
    ttl: float = TTL,
) -> None:
    """``gone`` (held by ``holder`` in ``stack``) was lost by a restart that kept ``kept``:
    ``second`` must not be granted it before ``holder`` was told, and ``kept`` stays held."""
    # at once: the grant is gone from Redis while its holder may still count it held
    with pytest.raises(LeaseBusy), second.hold(gone.resource, wait=0):
        pass
    with second.hold(gone.resource, wait=5 * ttl) as taken:
        granted_at = time.monotonic()
        assert taken.token > gone.token  # tokens keep growing across the restart
    with pytest.raises(LeaseLost):
        gone.check()
    kept.check()  # the grant from before the snapshot came back with it
    leave_lost(stack)
    (lost_at,) = lost_log.times(holder.identity().owner, gone.resource)
    assert lost_at <= granted_at, "the new holder was granted before the old one knew"


def hold_across(
    holder: Leases, stack: ExitStack, between: Callable[[], None], restart: Callable[[], None]
) -> tuple[Any, Any]:
    """Hold ``before``, run ``between`` (a snapshot), hold ``after``, then ``restart``."""
    kept = stack.enter_context(holder.hold("before"))
    between()
    gone = stack.enter_context(holder.hold("after"))
    poll(lambda: confirmed_once(gone), TTL, "a first renewal")
    restart()
    return kept, gone


def check_rdb_restore(server: RedisServer, make_leases: Any, lost_log: LostLog) -> None:
    holder = make_leases(redis_url=server.url, node="holder", ttl=TTL)
    second = make_leases(redis_url=server.url, node="second", ttl=TTL)
    client = admin(server.url)
    try:
        with ExitStack() as stack:
            kept, gone = hold_across(
                holder, stack, client.save, lambda: server.restart(keep_data=True)
            )
            store = holder.store
            assert client.exists(store.resource_keys("before").exclusive)
            assert not client.exists(store.resource_keys("after").exclusive)
            check_after_restart(holder, second, lost_log, stack, kept, gone)
    finally:
        client.close()


def test_rdb_restore_holds_off_grants_until_their_holders_know(
    make_redis_server: Callable[..., RedisServer], make_leases: Any, lost_log: LostLog
) -> None:
    check_rdb_restore(make_redis_server(), make_leases, lost_log)


def test_rdb_restore_on_redis_6_2(
    make_redis_server: Callable[..., RedisServer], make_leases: Any, lost_log: LostLog
) -> None:
    server = make_redis_server(binary=oldest_binary())
    with admin(server.url) as client:
        assert str(client.info("server")["redis_version"]).startswith("6.2.")
    check_rdb_restore(server, make_leases, lost_log)


def test_aof_that_lost_its_tail_holds_off_grants_until_their_holders_know(
    make_redis_server: Callable[..., RedisServer], make_leases: Any, lost_log: LostLog
) -> None:
    # appendfsync always: the file holds every write once its reply is sent, so cutting it
    # back to its size after "before" drops exactly what came later (an fsync that never
    # happened, a disk that lost its cache)
    server = make_redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    holder = make_leases(redis_url=server.url, node="holder", ttl=TTL)
    second = make_leases(redis_url=server.url, node="second", ttl=TTL)
    size = 0

    def mark() -> None:
        nonlocal size
        size = aof_file(server).stat().st_size

    def lose_the_tail() -> None:
        server.kill()
        path = aof_file(server)
        assert path.stat().st_size > size
        os.truncate(path, size)
        server.restart(keep_data=True)

    with ExitStack() as stack:
        kept, gone = hold_across(holder, stack, mark, lose_the_tail)
        with admin(server.url) as client:
            assert client.exists(holder.store.resource_keys("before").exclusive)
            assert not client.exists(holder.store.resource_keys("after").exclusive)
        check_after_restart(holder, second, lost_log, stack, kept, gone)


def test_failover_to_a_replica_that_lagged_holds_off_grants_until_their_holders_know(
    make_leases: Any, lost_log: LostLog
) -> None:
    # the replica is frozen (SIGSTOP) and its link cut before "after" is granted, so it never
    # gets that write; then the master dies and the sentinels promote the replica
    ttl = 10.0  # renewals stall while the sentinels fail over (a few seconds)
    with LocalSentinel(replicas=1, sentinels=3) as sentinel:
        master, replica = sentinel.data
        holder = make_leases(redis_url=sentinel.url, node="holder", ttl=ttl)
        second = make_leases(redis_url=sentinel.url, node="second", ttl=ttl)
        with ExitStack() as stack:
            kept = stack.enter_context(holder.hold("before"))
            with admin(master.url) as client:
                assert client.wait(1, 10_000) == 1  # "before" is on the replica
            replica.pause()
            try:
                with admin(master.url) as client:
                    client.client_kill_filter(_type="replica")
                gone = stack.enter_context(holder.hold("after"))
                master.kill()
            finally:
                replica.resume()
            promoted = sentinel.wait_for_new_master(master.port)
            assert promoted is replica
            with admin(replica.url) as client:
                assert client.exists(holder.store.resource_keys("before").exclusive)
                assert not client.exists(holder.store.resource_keys("after").exclusive)
            check_after_restart(holder, second, lost_log, stack, kept, gone, ttl=ttl)


def test_empty_restart_is_held_off_by_restart_grace(
    make_redis_server: Callable[..., RedisServer], make_leases: Any, lost_log: LostLog
) -> None:
    # an empty Redis cannot be told from a new one: restart_grace covers it, the default not
    server = make_redis_server()
    holder = make_leases(redis_url=server.url, node="holder", ttl=TTL, restart_grace=TTL)
    second = make_leases(redis_url=server.url, node="second", ttl=TTL, restart_grace=TTL)
    # a new Redis counts as just restarted too: the first grant waits out the grace
    with ExitStack() as stack:
        stack.enter_context(holder.hold("first", wait=5 * TTL))
        _kept, gone = hold_across(holder, stack, lambda: None, server.restart)
        with pytest.raises(LeaseBusy), second.hold(gone.resource, wait=0):
            pass
        with second.hold(gone.resource, wait=5 * TTL):
            granted_at = time.monotonic()
        with pytest.raises(LeaseLost):
            stack.close()
    (lost_at,) = lost_log.times(holder.identity().owner, "after")
    assert lost_at <= granted_at


def test_a_new_redis_grants_at_once_with_the_defaults(
    make_redis_server: Callable[..., RedisServer], make_leases: Any
) -> None:
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    started = time.monotonic()
    with leases.hold("r", wait=0) as lease:
        assert lease.token > 0
    assert time.monotonic() - started < leases.settings.ttl
    with admin(server.url) as client:
        record = client.get(leases.store.keys.lifetime(0))
    # the connection's check wrote the record (no grace), so a restore later is recognised
    assert record is not None
    assert record.decode().split()[1] == server_identity(admin(server.url))


@pytest.mark.asyncio
async def test_rdb_restore_holds_off_asyncio_grants_until_their_holders_know(
    make_redis_server: Callable[..., RedisServer], make_leases: Any, lost_log: LostLog
) -> None:
    server = make_redis_server()
    holder = make_leases(redis_url=server.url, node="holder", ttl=TTL)
    second = make_leases(redis_url=server.url, node="second", ttl=TTL)
    client = admin(server.url)
    try:
        async with AsyncExitStack() as stack:
            kept = await stack.enter_async_context(holder.ahold("before"))
            client.save()
            gone = await stack.enter_async_context(holder.ahold("after"))
            deadline = time.monotonic() + TTL
            while not confirmed_once(gone):
                assert time.monotonic() < deadline, "no first renewal"
                await asyncio.sleep(0.005)
            server.restart(keep_data=True)
            with pytest.raises(LeaseBusy):
                async with second.ahold("after", wait=0):
                    pass
            async with second.ahold("after", wait=5 * TTL) as taken:
                granted_at = time.monotonic()
                assert taken.token > gone.token
            with pytest.raises(LeaseLost):
                gone.check()
            kept.check()
            with pytest.raises(LeaseLost):
                await stack.aclose()
    finally:
        client.close()
        await holder.aclose()
        await second.aclose()
    (lost_at,) = lost_log.times(holder.identity().owner, "after")
    assert lost_at <= granted_at


def test_without_info_in_the_acl_a_warning_says_what_is_not_recognised(
    make_redis_server: Callable[..., RedisServer],
    make_leases: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = make_redis_server()
    with admin(server.url) as client:
        password = create_documented_user(client)
        client.execute_command("ACL", "SETUSER", USER, "-info")
    url = f"redis://{USER}:{password}@127.0.0.1:{server.port}/0"
    leases = make_leases(redis_url=url, key_prefix="leases")
    # grants go on: only the restart check is blind
    with caplog.at_level(logging.WARNING, logger="celery_leases._restart_check"), leases.hold("r"):
        pass
    (warning,) = [r for r in caplog.records if r.name == "celery_leases._restart_check"]
    assert "INFO is refused" in warning.getMessage()


def test_rdb_restore_of_one_cluster_node_holds_off_its_groups(
    make_leases: Any, lost_log: LostLog
) -> None:
    # each node has its own run id: the restored node's groups wait, the connection check of
    # a cluster client runs per group and skips the groups of the other nodes (MOVED)
    ttl = 10.0  # renewals stall while the node restarts and rejoins (a few seconds)
    with LocalCluster(masters=3) as cluster:
        settings: dict[str, Any] = {"redis_url": cluster.url, "slot_groups": 16, "ttl": ttl}
        holder = make_leases(node="holder", **settings)
        second = make_leases(node="second", **settings)
        # a node that does not serve group 0: every owner registers there first
        home = _port_of(holder, holder.store.keys.owners)
        server = next(s for s in cluster.servers if s.port != home)
        names = [f"c:{i}" for i in range(2000)]
        before, after = [n for n in names if _port_of(holder, _xkey(holder, n)) == server.port][:2]
        with ExitStack() as stack:
            kept = stack.enter_context(holder.hold(before))
            with admin(server.url) as client:
                client.save()
            gone = stack.enter_context(holder.hold(after))
            poll(lambda: confirmed_once(gone), ttl, "a first renewal")
            server.restart(keep_data=True)
            wait_until(lambda: _cluster_ok(server), 30, "the restored node serving its slots")
            # the groups of the other nodes are not held back
            elsewhere = next(n for n in names if _port_of(holder, _xkey(holder, n)) == home)
            with second.hold(elsewhere, wait=0):
                pass
            check_after_restart(holder, second, lost_log, stack, kept, gone, ttl=ttl)


def _cluster_ok(server: RedisServer) -> bool:
    with admin(server.url) as client:
        info = client.cluster("INFO")
    return bool(info.get("cluster_state") == "ok")


def _xkey(leases: Leases, name: str) -> str:
    return leases.store.resource_keys(name).exclusive


def _port_of(leases: Leases, key: str) -> int:
    """The port of the cluster node that serves ``key``."""
    node = leases.store.client.get_node_from_key(key)  # type: ignore[attr-defined]
    return int(node.port)


def test_rdb_restore_holds_off_the_takeover_of_a_unique_claim(
    make_redis_server: Callable[..., RedisServer], make_leases: Any
) -> None:
    # a running task's claim (taken over after the snapshot) is lost by the restore; a second
    # publish queues the same key again, and its worker must not take it over while the first
    # run may still count it held
    server = make_redis_server()
    first = make_leases(redis_url=server.url, node="first", ttl=TTL)
    other = make_leases(redis_url=server.url, node="other", ttl=TTL)
    store = first.store
    assert store.ping()  # connected: the records are there, and in the snapshot
    with admin(server.url) as client:
        client.save()
    store.unique_claim("u:1", "task-1", 60)
    running = store.unique_handover("u:1", "task-1", first.identity(), TTL)
    assert isinstance(running, Held)
    server.restart(keep_data=True)
    assert isinstance(other.store.unique_claim("u:1", "task-2", 60), Claimed)  # the claim is gone
    outcome = other.store.unique_handover("u:1", "task-2", other.identity(), TTL)
    assert isinstance(outcome, ClaimHolder)
    assert outcome.state == "grace"
