"""The token_memory setting: how long a resource's token counter stays in Redis, and none at 0.

A token is at least the Redis clock in microseconds at its grant; the counter key
(``{prefix:group}:n:<resource>``) also keeps it above the last token of the resource for
``token_memory`` seconds. With 0 no counter is written, so nothing of a resource is left
after its release, and the guards that need no memory still hold: a counter another caller
left is read, a shared grant stays above the live shared holders, a unique handover above
the queued claim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import Leases, Shared
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._sync.driver import LeaseStore
from celery_leases.exceptions import LeaseConfigError

A = Identity("node-a", "inc", 1)
B = Identity("node-b", "inc", 2)
#: far enough ahead of the Redis clock (µs) that only a guard can put a token above it
AHEAD_US = 3600 * 1_000_000


def _now_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def _resource_keys(store: LeaseStore, resource: str) -> list[str]:
    rk = store.resource_keys(resource)
    return [rk.exclusive, rk.shared, rk.counter]


def _keys_under(client: redis.Redis, prefix: str) -> set[str]:
    return set(client.scan_iter(match=f"{{{prefix}:*", count=1000))


@pytest.mark.parametrize("memory", [86400.0, 120.0, 0.5])
def test_the_counter_lives_as_long_as_the_setting(
    make_leases_store: Callable[..., LeaseStore], leases_redis: redis.Redis, memory: float
) -> None:
    store = make_leases_store(token_memory=memory)
    store.load_scripts()  # the first grant's start-up is not counted in its elapsed time
    memory_ms = int(memory * 1000)
    started = time.monotonic()
    held = store.try_acquire([Want("job:1")], A, 5.0)
    assert isinstance(held, list)
    claimed: Any = store.unique_claim("u:1", "task-1", 60)
    try:
        for resource in ("job:1", store.engine.keys.unique_resource("u:1")):
            counter = store.resource_keys(resource).counter
            pttl = leases_redis.pttl(counter)
            elapsed_ms = (time.monotonic() - started) * 1000
            # set by this grant: no more than the setting, less only by the time since
            assert memory_ms - elapsed_ms - 2 <= pttl <= memory_ms, (resource, pttl)
        assert int(leases_redis.get(store.resource_keys("job:1").counter)) == held[0].token
    finally:
        store.release(held)
        store.unique_unclaim("u:1", "task-1", claimed.token)


def test_the_default_keeps_the_counter_a_day(leases_store: LeaseStore) -> None:
    assert leases_store.engine.settings.token_memory == 86400.0
    assert leases_store.engine.token_memory_ms == 86_400_000


def test_zero_leaves_nothing_of_a_resource_after_its_release(
    make_leases: Callable[..., Leases], leases_redis: redis.Redis
) -> None:
    leases = make_leases(token_memory=0)
    store = leases.store
    tokens = []
    for round_ in range(6):
        before_us = _now_us(leases_redis)
        mode: Any = Shared("job:7") if round_ % 2 else "job:7"
        with leases.hold(mode, ttl=5) as lease:
            assert lease.token >= before_us  # the Redis clock at the grant
            tokens.append(lease.token)
            assert leases_redis.exists(store.resource_keys("job:7").counter) == 0
        assert leases_redis.exists(*_resource_keys(store, "job:7")) == 0
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing


def test_distinct_resources_leave_one_key_each_by_default_and_none_with_zero(
    make_leases: Callable[..., Leases],
    leases_redis: redis.Redis,
    leases_prefix: str,
) -> None:
    for memory, prefix in ((86400.0, f"{leases_prefix}-d"), (0.0, f"{leases_prefix}-z")):
        leases = make_leases(key_prefix=prefix, token_memory=memory)
        with leases.hold("warm-up", ttl=5):
            pass  # the owner's and the group's own keys exist from here on
        baseline = _keys_under(leases_redis, prefix)
        names = [f"report:{n}" for n in range(20)]
        for name in names:
            with leases.hold(name, ttl=5):
                pass
        left = _keys_under(leases_redis, prefix) - baseline
        if memory:
            assert left == {leases.store.resource_keys(n).counter for n in names}
        else:
            assert left == set()
        leases_redis.delete(*_keys_under(leases_redis, prefix))  # only this test's keys


def test_zero_reads_a_counter_left_by_a_caller_with_a_memory(
    make_leases_store: Callable[..., LeaseStore], leases_redis: redis.Redis
) -> None:
    # during a rollout from the default to 0, old workers still write counters
    counter = make_leases_store(token_memory=0).resource_keys("job:2").counter
    ahead = _now_us(leases_redis) + AHEAD_US
    leases_redis.set(counter, str(ahead), px=60_000)
    store = make_leases_store(token_memory=0)
    held = store.try_acquire([Want("job:2")], A, 5.0)
    assert isinstance(held, list)
    store.release(held)
    assert held[0].token == ahead + 1
    assert leases_redis.get(counter) == str(ahead)  # read, never written
    assert 0 < leases_redis.pttl(counter) <= 60_000
    # a unique claim's token as well
    claim_counter = store.resource_keys(store.engine.keys.unique_resource("u:4")).counter
    leases_redis.set(claim_counter, str(ahead), px=60_000)
    claimed: Any = store.unique_claim("u:4", "task-1", 60)
    assert claimed.token == ahead + 1
    assert leases_redis.get(claim_counter) == str(ahead)
    assert store.unique_unclaim("u:4", "task-1", claimed.token)


def test_zero_keeps_a_shared_grant_above_the_live_shared_holders(
    make_leases_store: Callable[..., LeaseStore], leases_redis: redis.Redis
) -> None:
    remembering = make_leases_store()  # the default memory
    forgetting = make_leases_store(token_memory=0)
    counter = remembering.resource_keys("pool").counter
    ahead = _now_us(leases_redis) + AHEAD_US
    leases_redis.set(counter, str(ahead), px=60_000)
    first = remembering.try_acquire([Want("pool", "s")], A, 5.0)
    assert isinstance(first, list)
    assert first[0].token == ahead + 1
    leases_redis.delete(counter)  # gone, as after token_memory seconds
    second = forgetting.try_acquire([Want("pool", "s")], B, 5.0)
    assert isinstance(second, list)
    try:
        assert second[0].token > first[0].token
        assert leases_redis.exists(counter) == 0
    finally:
        forgetting.release(second)
        remembering.release(first)


def test_zero_keeps_a_unique_handover_above_the_queued_claim(
    make_leases_store: Callable[..., LeaseStore], leases_redis: redis.Redis
) -> None:
    remembering = make_leases_store()
    forgetting = make_leases_store(token_memory=0)
    resource = remembering.engine.keys.unique_resource("u:2")
    counter = remembering.resource_keys(resource).counter
    ahead = _now_us(leases_redis) + AHEAD_US
    leases_redis.set(counter, str(ahead), px=60_000)
    claimed: Any = remembering.unique_claim("u:2", "task-1", 60)
    assert claimed.token == ahead + 1
    leases_redis.delete(counter)
    held: Any = forgetting.unique_handover("u:2", "task-1", A, 5.0)
    try:
        assert held.token > claimed.token
        assert leases_redis.exists(counter) == 0
    finally:
        forgetting.release([held])
    assert leases_redis.exists(*_resource_keys(forgetting, resource)) == 0


def test_zero_claims_and_hands_over_without_a_counter(
    make_leases_store: Callable[..., LeaseStore], leases_redis: redis.Redis
) -> None:
    store = make_leases_store(token_memory=0)
    resource = store.engine.keys.unique_resource("u:3")
    before_us = _now_us(leases_redis)
    claimed: Any = store.unique_claim("u:3", "task-1", 60)
    assert claimed.token >= before_us
    held: Any = store.unique_handover("u:3", "task-1", A, 5.0)
    assert held.token > claimed.token
    store.release([held])
    assert leases_redis.exists(*_resource_keys(store, resource)) == 0


@pytest.mark.parametrize("bad", [-1, -0.001, "a day", 10 * 365 * 86400 + 1])
def test_a_bad_token_memory_is_refused_at_start_up(
    make_leases: Callable[..., Leases], monkeypatch: pytest.MonkeyPatch, bad: object
) -> None:
    with pytest.raises(LeaseConfigError, match=r"'token_memory'.*keyword argument"):
        make_leases(token_memory=bad)
    monkeypatch.setenv("CELERY_LEASES_TOKEN_MEMORY", str(bad))
    with pytest.raises(LeaseConfigError, match=r"'token_memory'.*CELERY_LEASES_TOKEN_MEMORY"):
        make_leases()
    monkeypatch.delenv("CELERY_LEASES_TOKEN_MEMORY")
    app = Celery("token-memory-test", set_as_current=False)
    app.conf.leases_token_memory = bad
    with pytest.raises(LeaseConfigError, match=r"'token_memory'.*app.conf.leases_token_memory"):
        make_leases(app)


@pytest.mark.asyncio
async def test_zero_on_the_asyncio_path_leaves_nothing_either(
    make_leases: Callable[..., Leases], leases_redis: redis.Redis
) -> None:
    leases = make_leases(token_memory=0)
    try:
        tokens = []
        for mode in ("job:9", Shared("job:9"), "job:9"):
            async with leases.ahold(mode, ttl=5) as lease:
                tokens.append(lease.token)
                assert leases_redis.exists(leases.store.resource_keys("job:9").counter) == 0
            assert leases_redis.exists(*_resource_keys(leases.store, "job:9")) == 0
        assert tokens == sorted(set(tokens)), tokens
    finally:
        await leases.aclose()
