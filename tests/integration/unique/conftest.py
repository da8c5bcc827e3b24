"""Real ``celery worker`` (and ``celery beat``) subprocesses running ``unique_app``, and a producer.

Each test gets its own queue and key prefix. The test process sends through ``producer``, its
own copy of ``unique_app`` (same broker, queue and prefix as the workers), so that the claims it
takes are the ones the workers take over. Worker logs are printed when a test fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import Leases
from tests.support.polling import wait_until
from tests.support.workers import (
    WorkerProc,
    kill_whole_worker,
    pytest_runtest_makereport,
    worker_factory,
)

from . import unique_app

REPO = Path(__file__).resolve().parents[3]
APP = "tests.integration.unique.unique_app"
#: CELERY_LEASES_TTL of the workers (a running claim is a lease with this TTL)
WORKER_TTL = 3.0
#: the queue TTL of claims (CELERY_LEASES_UNIQUE_TTL) unless a test sets another
QUEUE_TTL = 120.0
RESULT_TIMEOUT = 30.0

__all__ = [
    "APP",
    "pytest_runtest_makereport",
    "REPO",
    "RESULT_TIMEOUT",
    "WORKER_TTL",
    "Ledger",
    "kill_whole_worker",
    "wait_until",
]


@pytest.fixture
def queue(leases_prefix: str) -> str:
    """The queue of this test's workers and producer."""
    return f"q-{leases_prefix}"


@pytest.fixture
def worker_env(leases_redis_url: str, leases_prefix: str, queue: str) -> dict[str, str]:
    """Environment of this test's workers and beat."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_LEASES_", "UAPP_"))}
    env.update(
        {
            "LEASES_TEST_BROKER": leases_redis_url,
            "LEASES_TEST_LEDGER": leases_redis_url,
            "LEASES_TEST_QUEUE": queue,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "CELERY_LEASES_TTL": str(WORKER_TTL),
            "CELERY_LEASES_UNIQUE_TTL": str(QUEUE_TTL),
            "CELERY_LEASES_RETRY_DELAY": "0.2",
            "CELERY_LEASES_RETRY_MAX_DELAY": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def make_producer(
    leases_redis_url: str, leases_prefix: str, queue: str
) -> Iterator[Callable[..., Celery]]:
    """Factory: ``make_producer(**settings)`` -> a ``unique_app`` copy for this test's queue."""
    made: list[Celery] = []

    def make(**settings: Any) -> Celery:
        settings.setdefault("redis_url", leases_redis_url)
        settings.setdefault("key_prefix", leases_prefix)
        settings.setdefault("ttl", WORKER_TTL)
        settings.setdefault("unique_ttl", QUEUE_TTL)
        broker = settings.pop("broker", leases_redis_url)
        app = unique_app.make_app(broker=broker, queue=queue, backend=leases_redis_url, **settings)
        made.append(app)
        return app

    yield make
    for app in made:
        app.leases.store.close()  # type: ignore[attr-defined]
        # app.close() closes the broker's connections, not the result backend's
        app.backend.client.connection_pool.disconnect()
        app.close()
    client = redis.Redis.from_url(leases_redis_url)
    try:
        client.delete(queue, f"_kombu.binding.{queue}")
    finally:
        client.close()


@pytest.fixture
def producer(make_producer: Callable[..., Celery]) -> Celery:
    """This test's producer app."""
    return make_producer()


@pytest.fixture
def leases_of(producer: Celery) -> Leases:
    """The producer's Leases (to inspect claims)."""
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    return ext


@dataclass
class Ledger:
    """What the tasks recorded, and the gates that let gated bodies end."""

    client: redis.Redis
    prefix: str

    def key(self, *parts: object) -> str:
        return unique_app.ledger_key(self.prefix, *parts)

    def events(self, name: str) -> list[str]:
        return [str(e) for e in self.client.lrange(self.key("events", name), 0, -1)]

    def started(self, key: str) -> list[str]:
        """Task ids whose body started for ``key``, in order."""
        return [e.split(" ", 1)[0] for e in self.events(f"started:{key}")]

    def wait_started(self, key: str, count: int = 1, timeout: float = RESULT_TIMEOUT) -> list[str]:
        return list(
            wait_until(
                lambda: (ids := self.started(key)) and len(ids) >= count and ids,
                timeout,
                f"{count} start(s) of a body for {key}",
            )
        )

    def open_gate(self, key: str) -> None:
        self.client.set(self.key("gate", key), "1", ex=600)


@pytest.fixture
def ledger(leases_redis_url: str, leases_prefix: str) -> Iterator[Ledger]:
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    yield Ledger(client, leases_prefix)
    client.close()


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    """Factory: ``start_worker(pool="prefork", concurrency=2, hostname=None, env=None)``."""
    with worker_factory(request.node, APP, worker_env, tmp_path, "u") as start:
        yield start
