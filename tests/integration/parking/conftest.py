"""Real ``celery worker`` subprocesses running ``park_app``, a producer and the ledger."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.support.workers import WorkerProc, pytest_runtest_makereport, worker_factory

from . import park_app

APP = "tests.integration.parking.park_app"
WORKER_TTL = 3.0

__all__ = ["pytest_runtest_makereport"]


@pytest.fixture
def queue(leases_prefix: str) -> str:
    return f"q-{leases_prefix}"


@pytest.fixture
def worker_env(leases_redis_url: str, leases_prefix: str, queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_LEASES_", "PAPP_"))}
    env.update(
        {
            "LEASES_TEST_BROKER": leases_redis_url,
            "LEASES_TEST_LEDGER": leases_redis_url,
            "LEASES_TEST_QUEUE": queue,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "CELERY_LEASES_TTL": str(WORKER_TTL),
            "CELERY_LEASES_HANDON_TIMEOUT": "5",
            "CELERY_LEASES_PARK_PUMP_INTERVAL": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def producer(leases_redis_url: str, leases_prefix: str, queue: str) -> Iterator[Celery]:
    app = park_app.make_app(
        broker=leases_redis_url, queue=queue, redis_url=leases_redis_url, key_prefix=leases_prefix
    )
    yield app
    app.leases.store.close()  # type: ignore[attr-defined]
    app.backend.client.connection_pool.disconnect()
    app.close()
    client = redis.Redis.from_url(leases_redis_url)
    try:
        client.delete(queue, f"_kombu.binding.{queue}", park_app.ledger_key(leases_prefix))
    finally:
        client.close()


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    with worker_factory(request.node, APP, worker_env, tmp_path, "p") as start:
        yield start
