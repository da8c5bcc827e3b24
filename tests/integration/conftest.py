"""Fixtures for the security tests: throwaway certificates and private TLS servers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_leases._redis_server import RedisServer
from tests.support.tls import Certs, make_certs


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1, client certificates (made once a session)."""
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def make_tls_server(
    make_redis_server: Callable[..., RedisServer], tls_certs: Certs
) -> Callable[..., RedisServer]:
    """Factory: a private TLS-only server that requires client certificates."""

    def make(**kwargs: Any) -> RedisServer:
        return make_redis_server(tls=tls_certs.server, **kwargs)

    return make


@pytest.fixture
def tls_server(make_tls_server: Callable[..., RedisServer]) -> RedisServer:
    """A private TLS-only server that requires client certificates."""
    return make_tls_server()
