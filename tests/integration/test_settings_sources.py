"""Settings from Celery's namespaced config and settings made after Leases(app), on Redis.

The keys a hold writes land under the prefix the config names: another Leases on that prefix
sees the holder, one on the default prefix does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from celery_leases import Leases


@pytest.fixture
def closing() -> Iterator[Callable[[Leases], Leases]]:
    made: list[Leases] = []

    def close_later(leases: Leases) -> Leases:
        made.append(leases)
        return leases

    yield close_later
    for leases in made:
        leases.store.close()


def test_namespaced_prefix_and_ttl_are_used_on_redis(
    leases_redis_url: str,
    leases_prefix: str,
    make_leases: Callable[..., Leases],
    closing: Callable[[Leases], Leases],
) -> None:
    class Settings:  # django.conf:settings as Celery sees it
        CELERY_BROKER_URL = leases_redis_url
        CELERY_LEASES_KEY_PREFIX = f"{leases_prefix}-ns"
        CELERY_LEASES_TTL = 7.0

    app = Celery("ns-redis", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    leases = closing(Leases(app))  # redis_url: the namespaced broker URL
    same_prefix = make_leases(key_prefix=f"{leases_prefix}-ns")
    default_prefix = make_leases()
    with leases.hold("shared-name") as lease:
        assert lease.ttl == 7.0
        assert [h.token for h in same_prefix.store.holders("shared-name")] == [lease.token]
        assert default_prefix.store.holders("shared-name") == []


def test_prefix_set_after_leases_is_used_on_redis(
    leases_redis_url: str,
    leases_prefix: str,
    make_leases: Callable[..., Leases],
    closing: Callable[[Leases], Leases],
) -> None:
    app = Celery("late-redis", set_as_current=False)
    leases = closing(Leases(app, redis_url=leases_redis_url))
    app.conf.leases_key_prefix = f"{leases_prefix}-late"  # after Leases(app), before first use
    late = make_leases(key_prefix=f"{leases_prefix}-late")
    with leases.hold("r") as lease:
        assert [h.token for h in late.store.holders("r")] == [lease.token]
    app.conf.leases_key_prefix = f"{leases_prefix}-later"  # after first use: refused
    with pytest.raises(ValueError, match="changed after their first use"), leases.hold("r"):
        raise AssertionError("not reached")
