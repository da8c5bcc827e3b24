"""Real ``celery worker`` subprocesses for the worker integration tests.

Each test gets its own queue and key prefix; workers are started with ``subprocess.Popen``,
waited for against a deadline, stopped with SIGTERM then SIGKILL, and their logs are printed
when the test fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_leases import Leases
from celery_leases._redis_server import url_answers
from tests.support.polling import wait_until
from tests.support.workers import (
    REPO,
    WorkerProc,
    amqp_url_or_skip,
    children_of,
    kill_whole_worker,
    pytest_runtest_makereport,
    worker_factory,
)

APP = "tests.integration.worker.worker_app"


@pytest.fixture
def queue(leases_prefix: str) -> str:
    """The queue of this test's workers."""
    return f"q-{leases_prefix}"


@pytest.fixture
def worker_env(leases_redis_url: str, leases_prefix: str, queue: str) -> dict[str, str]:
    """Environment for this test's workers (copy and change it per worker as needed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    env.update(
        {
            "LEASES_TEST_BROKER": leases_redis_url,
            "LEASES_TEST_BACKEND": leases_redis_url,
            "LEASES_TEST_LEDGER": leases_redis_url,
            "LEASES_TEST_QUEUE": queue,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "CELERY_LEASES_TTL": "3",
            "CELERY_LEASES_RETRY_DELAY": "0.2",
            "CELERY_LEASES_RETRY_MAX_DELAY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    """Factory: ``start_worker(pool="prefork", concurrency=2, hostname=None, env=None)``."""
    with worker_factory(request.node, APP, worker_env, tmp_path, "w") as start:
        yield start


@pytest.fixture
def worker_app(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The test app module, imported in this process (to send tasks and read the ledger)."""
    for key in ("LEASES_TEST_BROKER", "LEASES_TEST_BACKEND", "LEASES_TEST_LEDGER"):
        os.environ.setdefault(key, worker_env[key])
    import tests.integration.worker.worker_app as module

    monkeypatch.setattr(module, "PREFIX", worker_env["CELERY_LEASES_KEY_PREFIX"])
    return module


@dataclass
class Sender:
    """Sends tasks of the test app to this test's queue."""

    queue: str

    def __call__(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        options = kwargs.pop("_options", {})
        return task.apply_async(args, kwargs, queue=self.queue, **options)


@pytest.fixture
def send(queue: str) -> Sender:
    """``send(task, *args, **kwargs)`` -> AsyncResult, on this test's queue."""
    return Sender(queue)


@pytest.fixture
def test_leases(make_leases: Callable[..., Leases]) -> Leases:
    """A Leases in the test process on the workers' prefix (to inspect and contend)."""
    return make_leases(ttl=3)


@pytest.fixture
def ledger(worker_app: ModuleType, leases_redis_url: str) -> Iterator[Any]:
    """Read the ledger the tasks write."""
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)

    class Ledger:
        def key(self, *parts: object) -> str:
            return worker_app.ledger_key(*parts)

        def overlaps(self) -> int:
            return int(client.get(self.key("overlaps")) or 0)

        def runs(self) -> int:
            return int(client.get(self.key("runs")) or 0)

        def active(self, resource: str) -> int:
            """How many task bodies are inside ``resource`` now (entered, not yet left)."""
            return int(client.get(self.key("active", resource)) or 0)

        def tokens(self, resource: str) -> list[int]:
            return [int(t) for t in client.lrange(self.key("tokens", resource), 0, -1)]

        def events(self, name: str) -> list[str]:
            return list(client.lrange(self.key("events", name), 0, -1))

        def wait_event(self, name: str, timeout: float = 20.0) -> str:
            return str(wait_until(lambda: self.events(name), timeout, f"ledger event {name}")[0])

    yield Ledger()
    client.close()


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """RabbitMQ URL for broker tests; skipped when nothing answers (failure under CI)."""
    return amqp_url_or_skip()


__all__ = [
    "APP",
    "REPO",
    "WorkerProc",
    "children_of",
    "kill_whole_worker",
    "pytest_runtest_makereport",
    "url_answers",
    "wait_until",
]
