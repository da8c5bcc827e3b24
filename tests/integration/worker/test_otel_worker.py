"""celery_leases.otel in a real prefork worker: a leased task's spans carry the task."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel test extra")

from .conftest import wait_until

pytestmark = pytest.mark.worker


def test_a_leased_task_traces_its_acquire_hold_and_release(
    start_worker: Any, worker_app: Any, send: Any, leases_redis_url: str
) -> None:
    start_worker("prefork", 2, env={"LEASES_TEST_OTEL": "1"})
    result = send(worker_app.guarded, "otel", 0.2)
    result.get(timeout=30)
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    try:
        key = worker_app.ledger_key("spans")

        def spans() -> list[dict[str, Any]]:
            return [json.loads(x) for x in client.lrange(key, 0, -1)]

        def of_task() -> list[dict[str, Any]]:
            return [s for s in spans() if s["attributes"].get("celery.task_id") == result.id]

        wait_until(lambda: len(of_task()) >= 3, 20, "the task's three spans")
        by_name = {s["name"]: s for s in of_task()}
        assert sorted(by_name) == [
            "celery_leases.acquire",
            "celery_leases.hold",
            "celery_leases.release",
        ]
        acquire = by_name["celery_leases.acquire"]["attributes"]
        assert acquire["celery_leases.resource"] == "res:otel"
        assert acquire["celery_leases.outcome"] == "granted"
        assert acquire["celery.task_name"] == worker_app.guarded.name
        hold = by_name["celery_leases.hold"]
        assert hold["attributes"]["celery_leases.outcome"] == "released"
        assert hold["attributes"]["celery_leases.held_seconds"] >= 0.2
        assert (hold["end"] - hold["start"]) / 1e9 >= 0.2
    finally:
        client.close()
