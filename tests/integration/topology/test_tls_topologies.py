"""celery_leases over TLS to a real Redis Cluster and a real Sentinel set, from the URL alone.

Every process speaks TLS only and requires a client certificate signed by the test CA
(tests/support/tls.py): the cluster's nodes and its bus, the Sentinel set's master, replica (TLS
replication) and sentinels (TLS to the data servers and to each other). The URLs are the forms
docs/redis.md gives:

- ``rediss+cluster://host:port,...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``
- ``sentinel://host:port,.../0?master_name=...&ssl=true&sentinel_ssl=true&ssl_ca_certs=...``
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_leases import LeaseBackendError, LeaseBusy, LeaseConfigError, Leases
from celery_leases._connect import parse_target
from celery_leases._lease import Want
from tests.support.tls import Certs
from tests.support.topologies import (
    CLUSTER_SLOT_GROUPS,
    check_a_waiter_is_woken_by_the_release,
    leases_factory,
    resources_in_distinct_groups,
)
from tests.support.topology import LocalCluster, LocalSentinel


@pytest.fixture(scope="session")
def tls_cluster(tls_certs: Certs) -> Iterator[LocalCluster]:
    """A 3-primary Redis Cluster, TLS only (client ports and cluster bus)."""
    with LocalCluster(masters=3, tls=tls_certs.server) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tls_sentinel(tls_certs: Certs) -> Iterator[LocalSentinel]:
    """One master, one replica, three sentinels, all TLS only."""
    with LocalSentinel(replicas=1, sentinels=3, tls=tls_certs.server) as sentinel:
        yield sentinel


@pytest.fixture(params=["cluster", "sentinel"])
def deployment(request: pytest.FixtureRequest) -> LocalCluster | LocalSentinel:
    fixture = "tls_cluster" if request.param == "cluster" else "tls_sentinel"
    found: LocalCluster | LocalSentinel = request.getfixturevalue(fixture)
    return found


def _settings(deployment: LocalCluster | LocalSentinel) -> dict[str, int]:
    return {"slot_groups": CLUSTER_SLOT_GROUPS} if isinstance(deployment, LocalCluster) else {}


@pytest.fixture
def make(deployment: LocalCluster | LocalSentinel) -> Iterator[Callable[..., Leases]]:
    """``make(url=None, **settings)``: Leases on ``url`` (default: the deployment's TLS URL)."""
    prefix = f"tls-topo-{uuid.uuid4().hex[:8]}"
    with leases_factory(deployment.url, prefix, **_settings(deployment)) as make_leases:

        def make_on(url: str | None = None, **settings: object) -> Leases:
            return make_leases(**({"redis_url": url} if url else {}), **settings)

        yield make_on


def _without(url: str, *names: str) -> str:
    """``url`` with the query arguments ``names`` left out."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in names]
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_the_urls_name_tls_everywhere(deployment: LocalCluster | LocalSentinel) -> None:
    target = parse_target(deployment.url)
    assert target.options["ssl"] is True
    assert target.options["ssl_certfile"].endswith("client.crt")
    if isinstance(deployment, LocalCluster):
        assert deployment.url.startswith("rediss+cluster://")
        assert target.kind == "cluster"
        ports = [s.port for s in deployment.servers]
    else:
        assert target.kind == "sentinel"
        assert target.sentinel_options["ssl"] is True
        assert target.sentinel_options["ssl_ca_certs"].endswith("ca.crt")
        ports = [s.port for s in deployment.data] + deployment.sentinel_ports
    # no process has a plain-text port: each answers only TLS with the client certificate
    for port in ports:
        assert not _answers_plain(port), port


def _answers_plain(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


TTL = 3.0  # the renewal tests' lease ttl, in seconds


def test_hold_grants_renews_and_releases_over_tls(make: Callable[..., Leases]) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 3)
    # ttl 3 s: the first renewal opens a TLS connection to each node, which takes
    # hundreds of ms on a loaded 2-core machine (a 1 s ttl left it 0.48 s and failed there)
    with leases.hold(names, ttl=TTL) as held:
        with pytest.raises(LeaseBusy):
            make().acquire([Want(names[0])])  # a second client over TLS sees the grant
        time.sleep(TTL * 1.3)  # past the ttl: renewed over TLS by the heartbeat, on every node
        for lease in held:
            lease.check()
        for name in names:
            assert [h.owner for h in leases.store.holders(name)] == [leases.identity().owner]
    for name in names:
        assert leases.store.holders(name) == []  # released
    with leases.hold(names[0], ttl=5) as again:
        assert again.token > held[0].token


@pytest.mark.asyncio
async def test_ahold_grants_renews_and_releases_over_tls(make: Callable[..., Leases]) -> None:
    leases = make()
    names = resources_in_distinct_groups(leases, 3)
    try:
        async with leases.ahold(names, ttl=TTL) as held:  # ttl: as above
            with pytest.raises(LeaseBusy):
                leases.acquire([Want(names[-1])])  # the sync client sees the async grant
            await asyncio.sleep(TTL * 1.3)  # renewed past its ttl by the loop's heartbeat
            for lease in held:
                lease.check()
        assert all(leases.store.holders(name) == [] for name in names)
        await check_a_waiter_is_woken_by_the_release(leases, names[-1], 30)  # pub/sub over TLS
    finally:
        await leases.aclose()


@pytest.mark.parametrize("variant", ["no client certificate", "no TLS options", "plain scheme"])
def test_a_client_without_tls_or_certificate_is_refused(
    deployment: LocalCluster | LocalSentinel, make: Callable[..., Leases], variant: str
) -> None:
    url = deployment.url
    if variant == "no client certificate":
        url = _without(url, "ssl_certfile", "ssl_keyfile")
    elif variant == "no TLS options":  # TLS on, but trusting nothing of ours: no CA, no cert
        url = _without(url, "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
    elif isinstance(deployment, LocalCluster):
        url = "redis+cluster://" + url.split("://", 1)[1].split("?", 1)[0]
    else:
        url = url.split("&", 1)[0]  # sentinel://...?master_name=...: no TLS at all
    if isinstance(deployment, LocalCluster):
        # the sync cluster client reads the slot map as it is made: at Leases(app)
        with pytest.raises(LeaseConfigError) as config_error:
            make(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        assert "redis_url" in str(config_error.value)
        assert "not usable" in str(config_error.value)
    else:
        # found at first use, after asking every sentinel (each refuses; about 20 s, as
        # redis-py retries each sentinel 3 times with backoff)
        leases = make(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        with pytest.raises(LeaseBackendError) as info, leases.hold("x"):
            pass
        assert "sentinel://127.0.0.1:" in str(info.value)
        assert "No master found" in str(info.value)
    # the full URL gets in: the variant alone was refused
    assert make().store.ping()


@pytest.mark.asyncio
async def test_an_asyncio_client_without_a_certificate_is_refused_by_the_sentinels(
    tls_sentinel: LocalSentinel,
) -> None:
    # (a cluster refuses at Leases(app) already, as above: the sync client is made first)
    url = _without(tls_sentinel.url, "ssl_certfile", "ssl_keyfile")
    with leases_factory(url, f"tls-topo-{uuid.uuid4().hex[:8]}") as make_leases:
        leases = make_leases(socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            with pytest.raises(LeaseBackendError) as info:
                async with leases.ahold("x"):
                    pass
            assert "sentinel://127.0.0.1:" in str(info.value)
        finally:
            await leases.aclose()
