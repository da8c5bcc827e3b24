"""A Sentinel failover while tasks are parked and hand-ons are under way, with a real worker.

The leases live on a real Sentinel set (a master, two replicas, three sentinels); the broker
and the ledger on the test Redis. With ``min_replicas=1`` every park is on a replica before
its message is acked, so once the master is killed with SIGKILL and a replica promoted,
every task still runs, and runs once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.support.polling import wait_until
from tests.support.topology import LocalSentinel
from tests.support.workers import WorkerProc, worker_factory

from .conftest import APP
from .test_parking import DEADLINE, events, most_at_once

PER_TENANT = 40


@pytest.fixture
def sentinel() -> Iterator[LocalSentinel]:
    with LocalSentinel(replicas=2, sentinels=3) as s:
        yield s


@pytest.fixture
def start_sentinel_worker(
    request: pytest.FixtureRequest,
    worker_env: dict[str, str],
    sentinel: LocalSentinel,
    tmp_path: Path,
) -> Iterator[Callable[..., WorkerProc]]:
    env = {
        **worker_env,
        "CELERY_LEASES_REDIS_URL": sentinel.url,
        "CELERY_LEASES_MIN_REPLICAS": "1",
        # renewals fail while no master answers: a TTL well past the failover
        "CELERY_LEASES_TTL": "20",
        "CELERY_LEASES_HANDON_TIMEOUT": "30",
        "PAPP_SLOW": "0.2",
    }
    with worker_factory(request.node, APP, env, tmp_path, "pf") as start:
        yield start


def test_parked_tasks_run_once_through_a_failover(
    producer: Celery,
    leases_prefix: str,
    sentinel: LocalSentinel,
    start_sentinel_worker: Callable[..., WorkerProc],
) -> None:
    start_sentinel_worker(concurrency=4)
    client = redis.Redis.from_url(producer.conf.broker_url)
    erp = producer.tasks["park_app.erp"]
    for n in range(PER_TENANT):
        for tenant in "AB":
            erp.delay(tenant, n)

    def ends() -> int:
        return sum(1 for e in events(client, leases_prefix) if e[0] == "e")

    # some ran from hand-ons already; most are still parked
    wait_until(lambda: ends() >= 12, DEADLINE, "12 bodies done")
    old = sentinel.master()
    direct = redis.Redis.from_url(old.url)
    states = direct.hvals(f"{{{leases_prefix}:0}}:park-state")  # the one slot group
    direct.close()
    old.kill()
    sentinel.wait_for_new_master(old.port, timeout=60)
    at_failover = ends()

    def done() -> bool:
        return len({(e[1], e[2]) for e in events(client, leases_prefix) if e[0] == "e"}) == (
            2 * PER_TENANT
        )

    wait_until(done, DEADLINE, f"all {2 * PER_TENANT} tasks done")
    evs = events(client, leases_prefix)
    client.close()
    starts = Counter((e[1], e[2]) for e in evs if e[0] == "s")
    copies = sum(1 for e in evs if e[0] == "s" and e[4] > 0)
    published = sum(1 for e in evs if e[0] == "p")
    print(
        f"{2 * PER_TENANT} tasks: {at_failover} done at the failover, "
        f"{states.count(b'p')} parked and {states.count(b'h')} handed on at the kill, "
        f"{published} hand-ons published, {copies} runs from a hand-on, "
        f"{sum(1 for v in starts.values() if v == 1)} started once, "
        f"most at once {most_at_once(evs)}"
    )
    assert set(starts) == {(t, n) for t in "AB" for n in range(PER_TENANT)}
    assert max(starts.values()) == 1, [k for k, v in starts.items() if v > 1]
    most = most_at_once(evs)
    assert most["A"] <= 2, most
    assert most["B"] <= 2, most
    assert copies > PER_TENANT  # parking happened
    # not asserted: how many were parked at the kill, read from the old master just before
    # it (61 or 62 in most runs, but 0 in 2 of 5 runs on 2026-12-06, not understood yet)
