"""A worker killed with SIGKILL and started again under the same name (a restarted pod).

The dead incarnation's leases must be gone as soon as the new incarnation is up (its start-up
cleanup runs before the consumer, so before the "ready." line), long before their TTL; a node
with no past pays one Redis command for that cleanup.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from .conftest import kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: the lease TTL of these workers: far longer than a restart, so expiry cannot free the lease
LEASE_TTL = "60"
#: commands every client sends on connect, and the ones this test sends itself
_NOT_CLEANUP = ("client|", "hello", "ping", "info", "config|", "select", "auth", "command")


def _concurrency(pool: str) -> int:
    return 2 if pool == "prefork" else 1


def _incarnation(owner: str) -> str:
    return owner.rsplit("/", 2)[1]


def _leases_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR" in line and "leases" in line]


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_restart_under_same_name_frees_dead_incarnation_before_ready(
    pool: str, start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    store = test_leases.store
    worker = start_worker(pool, _concurrency(pool), env={"CELERY_LEASES_TTL": LEASE_TTL})
    rid = f"restart-{pool}"
    resource = f"res:{rid}"
    send(worker_app.sleeper, rid, 300)
    ledger.wait_event(f"started:{rid}")
    (held,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    assert held.node == worker.hostname
    old = _incarnation(held.owner)
    assert held.owner in store.node_owners(worker.hostname)

    kill_whole_worker(worker)
    killed_at = time.monotonic()
    (orphan,) = store.holders(resource)  # nobody releases it: the whole worker is gone
    assert orphan.token == held.token
    assert orphan.expires_in > float(LEASE_TTL) / 2

    worker.start()  # same hostname; returns once "ready." is in the new log
    up_after = time.monotonic() - killed_at
    assert store.holders(resource) == [], f"{resource} still held when the new worker is ready"
    # the lease would still be there if only its TTL could free it
    assert up_after < orphan.expires_in / 2
    stale = [o for o in store.node_owners(worker.hostname) if _incarnation(o) == old]
    assert stale == [], f"owners of the dead incarnation {old} are still registered"

    # the cleanup ran before the consumer started, so before the ready line
    log = worker.current_log()
    cleanup = (
        f"start-up cleanup of earlier incarnations of {worker.hostname} released 1 lease(s): "
        f"{resource}"
    )
    assert cleanup in log
    assert log.index(cleanup) < log.index("ready.")
    assert _leases_errors(log) == []

    # and the new incarnation serves the resource at once, with a newer fencing token
    ((name, token),) = send(worker_app.guarded, rid).get(timeout=20)["leases"]
    assert name == resource
    assert token > held.token
    assert store.holders(resource) == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_new_node_pays_one_command_at_start(
    pool: str, start_worker: Any, make_redis_server: Any
) -> None:
    server = make_redis_server()  # leases only; broker and backend stay on the shared Redis
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        client.config_resetstat()
        worker = start_worker(
            pool,
            _concurrency(pool),
            env={
                "CELERY_LEASES_REDIS_URL": server.url,
                "CELERY_LEASES_TTL": LEASE_TTL,  # the reaper's first pass is ttl / 3 away
                "CELERY_LEASES_RECONCILE_INTERVAL": "0",
            },
        )
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if not name.removeprefix("cmdstat_").startswith(_NOT_CLEANUP)
    }
    # Beside the cleanup's one SMEMBERS, the one connection the start-up opened ran the restart
    # check every new connection runs first (_restart_check): one script call, loaded first on a
    # server that never ran it (a NOSCRIPT EVALSHA, SCRIPT LOAD, EVALSHA), which reads the
    # clock and the lifetime record and writes it (a brand-new Redis has none)
    connection_check = {"evalsha": 2, "script|load": 1, "time": 1, "get": 1, "set": 1}
    assert calls == {"smembers": 1, **connection_check}, (
        f"start-up of a node with no past sent {calls}"
    )
    log = worker.current_log()
    assert "start-up cleanup" not in log
    assert _leases_errors(log) == []


def test_restart_frees_a_lease_taken_after_the_reconcile_forgot_the_idle_owner(
    start_worker: Any, worker_app: Any, send: Any, make_leases: Any, ledger: Any
) -> None:
    """With several slot groups, an owner re-registers under its node when it takes a lease.

    t0 a pool process takes and gives back a lease (its owner is registered under the node);
    t1 it idles past its liveness and a reconcile pass forgets it; t2 it takes a lease whose
    resource is not in the home slot group; t3 the whole worker is killed and restarted. The
    start-up cleanup lists the node's owners: the lease of t2 must be among them.
    """
    groups = 4
    store = make_leases(ttl=2, slot_groups=groups).store
    rid_a, rid_b = [r for r in (f"sg{i}" for i in range(64)) if store.keys.group_of(f"res:{r}")][:2]
    worker = start_worker(
        "prefork",
        1,
        env={
            "CELERY_LEASES_TTL": "2",
            "CELERY_LEASES_SLOT_GROUPS": str(groups),
            "CELERY_LEASES_RECONCILE_INTERVAL": "0.5",
        },
    )
    first = send(worker_app.guarded, rid_a).get(timeout=20)
    (child,) = worker.children()
    assert first["pid"] == child
    owners = store.node_owners(worker.hostname)
    (owner,) = [o for o in owners if o.endswith(f"/{child}")]
    wait_until(
        lambda: owner not in store.node_owners(worker.hostname),
        30,
        f"the reconcile to forget the idle owner {owner}",
    )

    send(worker_app.long_lease, rid_b, 300)
    ledger.wait_event(f"started:{rid_b}")
    resource = f"res:{rid_b}"
    (held,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    assert held.owner == owner
    registered = owner in store.node_owners(worker.hostname)
    kill_whole_worker(worker)  # now, so that a failure does not wait for the task at teardown
    assert registered, (
        f"{owner} holds {resource} but is not registered under its node {worker.hostname}: a "
        "restart of the node cannot find the lease"
    )

    worker.env = {**worker.env, "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
    worker.start()
    assert store.holders(resource) == [], f"{resource} still held when the new worker is ready"
