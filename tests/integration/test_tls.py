"""celery_leases through ``rediss://`` to a TLS-only server that requires client certificates.

Certificates are made at test time with the ``openssl`` command (tests/support/tls.py); the URLs are
the forms docs/security.md tells users to write.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from celery_leases import LeaseBackendError, Leases
from celery_leases._redis_server import RedisServer
from celery_leases.config import resolve_settings
from tests.integration.tour import TOUR_TTL, tour
from tests.support.tls import Certs, tls_url


def test_the_engine_runs_through_mutual_tls(
    tls_server: RedisServer, make_leases: Callable[..., Leases]
) -> None:
    url = tls_url(tls_server)
    assert url.startswith("rediss://")
    admin = redis.Redis.from_url(tls_server.url)
    admin.script_flush()  # the first calls take the SCRIPT LOAD fallback, through TLS too
    tour(make_leases(redis_url=url, key_prefix="leases", ttl=TOUR_TTL))
    # every connection the library made was TLS with a certificate: the server has no other
    # port, and its clients are the library's (named celery_leases) and this admin
    clients = admin.client_list()
    assert any(c.get("name") == "celery_leases" for c in clients), clients
    assert admin.config_get("port") == {"port": "0"}
    admin.close()


@pytest.mark.parametrize(
    "variant",
    ["no client certificate", "a stranger's certificate", "server not trusted", "plain redis://"],
)
def test_a_client_without_the_right_certificates_is_refused(
    tls_server: RedisServer, tls_certs: Certs, make_leases: Callable[..., Leases], variant: str
) -> None:
    if variant == "no client certificate":
        url = tls_url(tls_server, client_cert=False)
    elif variant == "a stranger's certificate":
        url = tls_url(
            tls_server, certfile=tls_certs.stranger_certfile, keyfile=tls_certs.stranger_keyfile
        )
    elif variant == "server not trusted":
        url = tls_url(tls_server, ca_certs=tls_certs.other_ca)
    else:
        url = f"redis://127.0.0.1:{tls_server.port}/15"
    leases = make_leases(redis_url=url, key_prefix="leases", socket_timeout=2.0)
    with pytest.raises(LeaseBackendError) as info:
        leases.store.ping()
    assert f"127.0.0.1:{tls_server.port}" in str(info.value)
    with pytest.raises(LeaseBackendError), leases.hold("x"):
        pass
    # the same URL with the right files gets in: the variant alone was refused
    assert make_leases(redis_url=tls_url(tls_server), key_prefix="leases").store.ping()


def test_redis_server_tls_probe_and_url(tls_server: RedisServer, tls_certs: Certs) -> None:
    # RedisServer's own readiness probe and url use the client certificate
    assert tls_server.tls == tls_certs.server
    client = redis.Redis.from_url(tls_server.url)
    assert client.info("server")["process_id"] == tls_server.pid
    client.close()
    settings = resolve_settings(None, redis_url=tls_server.url)
    assert settings.redis_url == tls_server.url
