"""A Sentinel failover while tasks are parked and hand-ons are under way, with a real worker.

The leases live on a real Sentinel set (a master, two replicas, three sentinels); the broker
and the ledger on the test Redis. The test itself holds ``erp:A`` (exclusive, ``min_replicas=1``
too), so every task of tenant A parks: the master is killed once all 40 are parked, while the
tasks of B run, park and are handed on. With ``min_replicas=1`` every park is on a replica
before its message is acked: the 40 parked tasks of A are on the new master, in their order,
and once the test lets ``erp:A`` go every task runs, and runs once.

Without the test's hold the count parked at the kill is luck: the 80 tasks are sent A, B, A,
B..., and a 4-slot worker takes them 4 at a time, 2 per tenant, which ``limit=2`` admits; a
task parks only once the slots drift out of step (in 4 of 6 runs not before the 12th end).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import Leases
from celery_leases._parking import list_parked
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
    make_leases: Callable[..., Leases],
) -> None:
    # no deferring task in its app: its release hands nothing on (the worker's pump does)
    holder = make_leases(redis_url=sentinel.url, min_replicas=1, ttl=30.0)
    start_sentinel_worker(concurrency=4)
    client = redis.Redis.from_url(producer.conf.broker_url)
    erp = producer.tasks["park_app.erp"]
    with holder.hold("erp:A") as lease:
        for n in range(PER_TENANT):
            for tenant in "AB":
                erp.delay(tenant, n)
        wait_until(
            lambda: len(_parked(holder, "erp:A")) == PER_TENANT,
            DEADLINE,
            f"all {PER_TENANT} tasks of A parked",
        )
        old = sentinel.master()
        keys = holder.store.keys
        direct = redis.Redis.from_url(old.url)
        at_kill = [k.decode() for k in direct.zrange(keys.parked("erp:A"), 0, -1)]
        states = direct.hvals(keys.park_state(0))  # the one slot group: A's and B's
        direct.close()
        old.kill()
        sentinel.wait_for_new_master(old.port, timeout=60)
        at_failover = sum(1 for e in events(client, leases_prefix) if e[0] == "e")
        # read from the old master just before the kill: every task of A, parked
        assert len(at_kill) == PER_TENANT
        assert states.count(b"p") >= PER_TENANT
        wait_until(
            lambda: [p["task_id"] for p in _parked(holder, "erp:A")] == at_kill,
            60,
            f"the {PER_TENANT} parked tasks of A, in their order, on the new master",
        )
        assert {p["state"] for p in _parked(holder, "erp:A")} == {"parked"}
        lease.check()

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
        f"{states.count(b'p')} parked ({len(at_kill)} of A) and {states.count(b'h')} handed "
        f"on at the kill, {published} hand-ons published, {copies} runs from a hand-on, "
        f"{sum(1 for v in starts.values() if v == 1)} started once, "
        f"most at once {most_at_once(evs)}"
    )
    assert set(starts) == {(t, n) for t in "AB" for n in range(PER_TENANT)}
    assert max(starts.values()) == 1, [k for k, v in starts.items() if v > 1]
    most = most_at_once(evs)
    assert most["A"] <= 2, most
    assert most["B"] <= 2, most
    # every task of A ran from its hand-on, after the failover
    assert all(e[4] > 0 for e in evs if e[0] == "s" and e[1] == "A")
    assert copies > PER_TENANT  # and some of B parked too


def _parked(leases: Leases, resource: str) -> list[Any]:
    try:
        return list_parked(leases, resource)
    except Exception:  # the client finds the new master on its next try
        return []
