"""Session-wide private Redis deployments: a Redis Cluster and a Sentinel set.

Loaded by tests/conftest.py. Each starts on first use (a few seconds) and stops at the end of
the session; tests keep to their own key prefix on them, as on the shared server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import Leases
from tests.support.topology import LocalCluster, LocalSentinel

#: slot groups the tests use on the cluster, so that leases spread over its three primaries
CLUSTER_SLOT_GROUPS = 16


@dataclass
class Topology:
    name: str
    url: str
    servers: list[str]  # every data server, for INFO commandstats
    settings: dict[str, Any]

    def env(self) -> dict[str, str]:
        """The ``CELERY_LEASES_*`` environment that points a subprocess at this deployment."""
        out = {"CELERY_LEASES_REDIS_URL": self.url}
        out.update({f"CELERY_LEASES_{k.upper()}": str(v) for k, v in self.settings.items()})
        return out


@pytest.fixture(params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest) -> Topology:
    if request.param == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        return Topology(
            "cluster",
            cluster.url,
            [s.url for s in cluster.servers],
            {"slot_groups": CLUSTER_SLOT_GROUPS},
        )
    sentinel: LocalSentinel = request.getfixturevalue("redis_sentinel")
    return Topology("sentinel", sentinel.url, [s.url for s in sentinel.data], {})


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A 3-primary Redis Cluster on loopback ports (``.url`` is ``redis+cluster://...``)."""
    with LocalCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_cluster_replicated() -> Iterator[LocalCluster]:
    """A 3-primary Redis Cluster with one replica per primary (for ``min_replicas``)."""
    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[LocalSentinel]:
    """One master, one replica, three sentinels (``.url`` is ``sentinel://...``)."""
    with LocalSentinel(replicas=1, sentinels=3) as sentinel:
        yield sentinel


@contextmanager
def leases_factory(url: str, prefix: str, **defaults: Any) -> Iterator[Callable[..., Leases]]:
    """``make(**settings)`` -> a new ``Leases`` on ``url`` and ``prefix``; all closed on exit."""
    made: list[Leases] = []

    def make(**settings: Any) -> Leases:
        kw = {"redis_url": url, "key_prefix": prefix, **defaults, **settings}
        leases = Leases(Celery(f"{prefix}-{len(made)}", set_as_current=False), **kw)
        made.append(leases)
        return leases

    try:
        yield make
    finally:
        for leases in made:
            leases.store.close()


def command_calls(urls: list[str]) -> dict[str, int]:
    """Commands executed on every server of ``urls`` since their last CONFIG RESETSTAT."""
    total: dict[str, int] = {}
    for url in urls:
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            for name, values in client.info("commandstats").items():
                cmd = name.removeprefix("cmdstat_")
                total[cmd] = total.get(cmd, 0) + int(values["calls"])
        finally:
            client.close()
    return total


def reset_stats(urls: list[str]) -> None:
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            client.config_resetstat()
        finally:
            client.close()


async def check_a_waiter_is_woken_by_the_release(leases: Leases, name: str, wait: float) -> None:
    """A coroutine waiting for ``name`` gets it once the holder's block ends: woken by the
    release's notification, since the holder's TTL is an hour."""
    order: list[str] = []

    async def waiter() -> None:
        async with leases.ahold(name, ttl=10, wait=wait):
            order.append("waiter")

    async with leases.ahold(name, ttl=3600):
        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.2)  # the waiter starts waiting (it cannot get in either way)
        order.append("holder done")
    await asyncio.wait_for(task, wait)
    assert order == ["holder done", "waiter"]


def resources_in_distinct_groups(leases: Leases, count: int) -> list[str]:
    """``count`` resource names that land in different slot groups (where there are several)."""
    seen: dict[int, str] = {}
    i = 0
    while len(seen) < min(count, leases.store.settings.slot_groups):
        name = f"spread:{i}"
        seen.setdefault(leases.store.keys.group_of(name), name)
        i += 1
    names = list(seen.values())
    while len(names) < count:
        names.append(f"spread:extra:{len(names)}")
    return names
