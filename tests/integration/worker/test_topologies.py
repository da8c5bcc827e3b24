"""Real workers whose leases live on a Redis Cluster or behind Sentinel.

The broker, result backend and ledger stay on the shared test Redis: only the leases move.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_leases import Leases

pytestmark = pytest.mark.worker

RESOURCES = [f"topo-{i}" for i in range(4)]
TASKS = 40


def test_workers_exclude_each_other_on_the_deployment(
    topology: Any, start_worker, worker_app, send, ledger, leases_prefix: str
) -> None:
    env = topology.env()
    start_worker("prefork", 2, env=env)
    start_worker("threads", 2, env=env)
    results = [send(worker_app.guarded, RESOURCES[i % len(RESOURCES)], 0.05) for i in range(TASKS)]
    done = [r.get(timeout=120) for r in results]

    assert ledger.runs() == TASKS
    assert ledger.overlaps() == 0
    for resource in RESOURCES:
        name = f"res:{resource}"
        tokens = ledger.tokens(name)
        assert tokens == sorted(tokens), f"tokens of {name} went backwards"
        assert len(set(tokens)) == len(tokens)
    assert {d["leases"][0][0] for d in done} == {f"res:{r}" for r in RESOURCES}
    # nothing is left held on the deployment
    inspect = Leases(
        Celery("inspect", set_as_current=False),
        key_prefix=leases_prefix,
        **topology.settings,
        redis_url=topology.url,
    )
    try:
        for resource in RESOURCES:
            assert inspect.store.holders(f"res:{resource}") == []
    finally:
        inspect.store.close()
