"""Load: hundreds of leased tasks on a few resources, three workers of three pools, one queue.

Every task must succeed (busy ones retry), no two bodies may ever hold one resource at once,
and each resource's fencing tokens, recorded under the lease in grant order, must grow.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import pytest

from .conftest import wait_until

pytestmark = pytest.mark.worker

TASKS = 400
RESOURCES = 4
BODY_SECONDS = 0.01


def test_hundreds_of_leased_tasks_on_few_resources_across_three_pools(
    start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    env = {"CELERY_LEASES_RETRY_DELAY": "0.05", "CELERY_LEASES_RETRY_MAX_DELAY": "0.4"}
    workers = [
        start_worker("prefork", 2, env=env),
        start_worker("threads", 4, env=env),
        start_worker("solo", 1, env=env),
    ]
    rids = [f"hot{i}" for i in range(RESOURCES)]
    started = time.monotonic()
    results = [send(worker_app.guarded, rids[i % RESOURCES], BODY_SECONDS) for i in range(TASKS)]

    def done() -> bool:
        return all(r.ready() for r in results)

    wait_until(done, 90, f"{TASKS} leased tasks to finish", step=0.2)
    elapsed = time.monotonic() - started
    outcomes = [r.get(timeout=1) for r in results]  # raises if any failed

    assert ledger.runs() == TASKS
    assert ledger.overlaps() == 0
    per_resource: dict[str, list[int]] = {}
    for out in outcomes:
        ((resource, token),) = out["leases"]
        per_resource.setdefault(resource, []).append(token)
    assert sorted(per_resource) == [f"res:{rid}" for rid in rids]
    for resource, tokens in per_resource.items():
        granted = ledger.tokens(resource)  # pushed under the lease, so in grant order
        assert sorted(granted) == sorted(tokens), f"{resource}: ledger and results disagree"
        assert all(a < b for a, b in itertools.pairwise(granted)), (
            f"{resource}: fencing tokens did not grow in grant order: {granted}"
        )
        assert test_leases.store.holders(resource) == []

    # every pool took part: pids of the prefork children, the threads and solo main processes
    by_pid = Counter(out["pid"] for out in outcomes)
    for worker in workers:
        pids = set(worker.children()) if worker.pool == "prefork" else {worker.pid}
        assert sum(by_pid[p] for p in pids) > 0, f"{worker.pool} worker ran no task"
    retried = sum(w.log().count("] retry: retrying in") for w in workers)
    assert retried > 0, "no task ever found its resource busy: the load did not contend"
    print(f"{TASKS} tasks on {RESOURCES} resources in {elapsed:.1f}s; {retried} busy retries")
