"""Golden test of what is stored in Redis: values, scores and token semantics, pinned.

Why it exists: during a rolling deploy old and new workers run side by side against one Redis,
and each reads what the other wrote: the holder of an exclusive key, a shared holder's member,
a dead owner's registry entries, the liveness index, beat and unique claims, receipts, fence
records. A value one version writes in a form the other cannot read is a lease nobody frees,
or two holders of one resource. A change here breaks a fleet mid-rollout. The expected values
are written out literally (key names included, with the test's random prefix the only
variable part): changing one needs a migration note in docs/rollout.md that says how a fleet
with both versions stays correct.

Every value is read with a plain client after real calls through the public API (``hold``,
``acquire``, ``once``, :class:`~celery_leases.fence.FencedRedis`) or the store (beat and
unique claims). The key names alone, for more prefixes and names, are pinned by
tests/unit/test_wire_format_keys.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_leases import Leases, Shared
from celery_leases._lease import Want
from celery_leases.fence import FencedRedis

#: a resource name with a brace, a colon, spaces, "%" and unicode; escaped in key names
RESOURCE = "job:{42} 100% ключ"
ESCAPED = "job:%7B42%7D%20100%25%20ключ"
#: the worker's node name, and that name as it appears in owner ids and key names
NODE = "celery@web 1{x}"
NODE_PART = "celery@web%201%7Bx%7D"
TTL_MS = 30_000


def _owner_pattern() -> str:
    return rf"{re.escape(NODE_PART)}/[0-9a-f]{{12}}/{os.getpid()}"


def _now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _now_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.fixture(params=[1, 16], ids=["1-group", "16-groups"])
def slot_groups(request: pytest.FixtureRequest) -> int:
    value: int = request.param
    return value


@pytest.fixture
def ext(make_leases: Callable[..., Leases], slot_groups: int) -> Leases:
    return make_leases(node=NODE, slot_groups=slot_groups)


def _group(slot_groups: int, group_in_16: int) -> int:
    """The slot group of a name: 0 with one group, else the CRC32 group written out."""
    return 0 if slot_groups == 1 else group_in_16


def test_owner_id_is_node_incarnation_pid(ext: Leases) -> None:
    owner = ext.identity().owner
    assert re.fullmatch(_owner_pattern(), owner), owner


def test_exclusive_grant(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p, g = leases_prefix, _group(slot_groups, 8)
    owner = ext.identity().owner
    before_us = _now_us(leases_redis)
    (lease,) = ext.acquire([Want(RESOURCE)], ttl=TTL_MS / 1000, task_id="task 1/a")
    try:
        now_ms = _now_ms(leases_redis)
        token = lease.token
        assert token >= before_us  # a token is at least the Redis clock (µs) at its grant

        exclusive = f"{{{p}:{g}}}:x:{ESCAPED}"
        assert leases_redis.get(exclusive) == f"{token} {owner}"
        assert 0 < leases_redis.pttl(exclusive) <= TTL_MS
        assert leases_redis.get(f"{{{p}:{g}}}:n:{ESCAPED}") == str(token)

        # registry entry "<mode> <token> <escaped task id>%c<call id> <resource>": the resource
        # unescaped, the id of the grant call that made it after the task id (issue 26, part 8);
        # and "~", which keeps the set and its expiry while the owner holds nothing
        registry = f"{{{p}:{g}}}:reg:{owner}"
        (entry,) = leases_redis.smembers(registry) - {"~"}
        assert re.fullmatch(rf"x {token} task%201/a%c[0-9a-f]+ {re.escape(RESOURCE)}", entry)
        assert "~" in leases_redis.smembers(registry)
        assert leases_redis.pttl(registry) > 2 * TTL_MS

        # the owners index, scored by the Redis time (ms) the owner's liveness runs out
        score = leases_redis.zscore(f"{{{p}:0}}:owners", owner)
        assert score is not None
        assert token // 1000 + TTL_MS - 1 <= score <= now_ms + TTL_MS
        assert leases_redis.smembers(f"{{{p}:0}}:node:{NODE_PART}") == {owner}
        assert leases_redis.smembers(f"{{{p}:0}}:nodes") == {NODE_PART}

        # the lifetime record "<grace until, ms> <run_id>/<master_replid>" of each group used
        for group in {0, g}:
            life = leases_redis.get(f"{{{p}:{group}}}:life")
            assert life is not None
            assert re.fullmatch(r"\d+ [0-9a-f]{40}/[0-9a-f]{40}", life), life
    finally:
        ext.release([lease])
    assert leases_redis.exists(exclusive) == 0
    assert leases_redis.smembers(registry) == {"~"}
    assert leases_redis.pttl(registry) > 2 * TTL_MS


def test_revocation_mark(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    """``{<prefix>:<g>}:rv:<resource>`` = ``"<deadline ms> <newest token covered> <reason>"``,
    expiring at the deadline, in the resource's slot group (issue 31)."""
    p, g = leases_prefix, _group(slot_groups, 8)
    (lease,) = ext.acquire([Want(RESOURCE)], ttl=TTL_MS / 1000)
    try:
        before_ms = _now_ms(leases_redis)
        ext.revoke(RESOURCE, reason="a reason, with spaces", deadline=20)
        after_ms = _now_ms(leases_redis)
        mark = f"{{{p}:{g}}}:rv:{ESCAPED}"
        deadline, token, reason = leases_redis.get(mark).split(" ", 2)
        assert before_ms + 20_000 <= int(deadline) <= after_ms + 20_000
        assert (int(token), reason) == (lease.token, "a reason, with spaces")
        assert 0 < leases_redis.pttl(mark) <= 20_000
        assert 0 < leases_redis.pttl(f"{{{p}:{g}}}:x:{ESCAPED}") <= 20_000
    finally:
        ext.release([lease])


def test_shared_grant(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p, g = leases_prefix, _group(slot_groups, 8)
    owner = ext.identity().owner
    with ext.hold(Shared(RESOURCE), ttl=TTL_MS / 1000) as lease:
        now_ms = _now_ms(leases_redis)
        token = lease.token
        # member "<token> <owner>", scored by the Redis time (ms) this holder's lease runs out
        members = leases_redis.zrange(f"{{{p}:{g}}}:s:{ESCAPED}", 0, -1, withscores=True)
        assert [member for member, _ in members] == [f"{token} {owner}"]
        assert token // 1000 + TTL_MS - 1 <= members[0][1] <= now_ms + TTL_MS
        assert leases_redis.get(f"{{{p}:{g}}}:n:{ESCAPED}") == str(token)
        registry = f"{{{p}:{g}}}:reg:{owner}"
        (entry,) = leases_redis.smembers(registry) - {"~"}
        assert re.fullmatch(rf"s {token} -%c[0-9a-f]+ {re.escape(RESOURCE)}", entry)
        assert "~" in leases_redis.smembers(registry)
        assert leases_redis.exists(f"{{{p}:{g}}}:x:{ESCAPED}") == 0


def test_once_receipt(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p, g = leases_prefix, _group(slot_groups, 11)
    owner = ext.identity().owner
    assert ext.once("rc {1}", lambda: {"rows": 3}) == {"rows": 3}
    text = leases_redis.get(f"{{{p}:{g}}}:receipt:rc%20%7B1%7D")
    assert text is not None
    receipt = json.loads(text)
    assert set(receipt) == {"value", "created_at", "owner", "token"}
    assert receipt["value"] == {"rows": 3}
    assert receipt["owner"] == owner
    assert isinstance(receipt["created_at"], float)
    # the token of the lease that guarded the initializer: its resource's counter
    counter = leases_redis.get(f"{{{p}:{g}}}:n:celery_leases:once:rc%20%7B1%7D")
    assert receipt["token"] == int(str(counter))
    assert ext.receipt("rc {1}") == {"rows": 3}


def test_beat_claims(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p = leases_prefix
    won, run, now_ms, winner = ext.store.beat_claim(
        "e 1", due_ms=1_700_000_000_000, bucket=None, replica="beat@h 1", keep=60
    )
    assert (won, run, winner) == (True, 1_700_000_000_000, "beat@h 1")
    cron = f"{{{p}:{_group(slot_groups, 14)}}}:beat-cron:e%201"
    # "<run id> <Redis ms of the claim> <winner>"
    assert leases_redis.get(cron) == f"1700000000000 {now_ms} beat@h 1"

    won, run, now_ms, winner = ext.store.beat_claim(
        "e 1", due_ms=None, bucket=10.0, replica="beat@h 1", keep=60
    )
    assert (won, winner) == (True, "beat@h 1")
    assert run == now_ms // 10_000  # the run id of an interval: the Redis-time bucket
    every = f"{{{p}:{_group(slot_groups, 4)}}}:beat-every:e%201"
    assert leases_redis.get(every) == f"{run} {now_ms} beat@h 1"


def test_a_beat_claim_key_of_the_older_form_is_still_read(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    """A key written by a replica of a version before the Redis ms was recorded:
    ``"<run id> <replica>"``. Its run and winner still count; no early check applies."""
    cron = f"{{{leases_prefix}:{_group(slot_groups, 14)}}}:beat-cron:e%201"
    leases_redis.set(cron, "1700000000000 beat@old 1", px=60_000)
    won, _, _, winner = ext.store.beat_claim(
        "e 1", due_ms=1_700_000_000_000, bucket=None, replica="beat@h 1", keep=60
    )
    assert (won, winner) == (False, "beat@old 1")
    won, _, now_ms, _ = ext.store.beat_claim(
        "e 1", due_ms=1_700_000_060_000, bucket=None, replica="beat@h 1", keep=60
    )
    assert won
    assert leases_redis.get(cron) == f"1700000060000 {now_ms} beat@h 1"


def test_queued_unique_claim(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p, g = leases_prefix, _group(slot_groups, 13)
    claimed: Any = ext.store.unique_claim("k {1}", "tid 1", 60)
    now_ms = _now_ms(leases_redis)
    token = claimed.token
    key = f"{{{p}:{g}}}:x:celery_leases:unique:k%20%7B1%7D"
    assert leases_redis.get(key) == f"{token} %queued/tid%201"
    assert leases_redis.get(f"{{{p}:{g}}}:n:celery_leases:unique:k%20%7B1%7D") == str(token)
    # the index of queued claims: the claim's resource (unescaped), scored by its expiry (ms)
    queued = leases_redis.zrange(f"{{{p}:{g}}}:unique-queued", 0, -1, withscores=True)
    assert [member for member, _ in queued] == ["celery_leases:unique:k {1}"]
    assert token // 1000 + 60_000 - 1 <= queued[0][1] <= now_ms + 60_000
    assert ext.store.unique_unclaim("k {1}", "tid 1", token)


def test_fenced_write(ext: Leases, leases_redis: redis.Redis, leases_prefix: str) -> None:
    fenced = FencedRedis(leases_redis, prefix=leases_prefix)
    with ext.hold(RESOURCE, ttl=TTL_MS / 1000) as lease:
        assert fenced.set("acct {7}", "v1", fence=lease)
    data = f"{{{leases_prefix}:acct%20%7B7%7D}}"
    assert leases_redis.get(data) == "v1"
    assert leases_redis.get(f"{data}:fence") == str(lease.token)  # the last accepted token


def test_tokens_grow_per_resource_even_without_the_counter(
    ext: Leases, leases_redis: redis.Redis, leases_prefix: str, slot_groups: int
) -> None:
    p, g = leases_prefix, _group(slot_groups, 8)
    tokens: list[int] = []
    for round_ in range(12):
        if round_ % 3 == 2:  # the counter key evicted or deleted (it has a long TTL)
            assert leases_redis.delete(f"{{{p}:{g}}}:n:{ESCAPED}") == 1
        before_us = _now_us(leases_redis)
        mode: Any = Shared(RESOURCE) if round_ % 2 else RESOURCE
        with ext.hold(mode, ttl=TTL_MS / 1000) as lease:
            assert lease.token >= before_us
            tokens.append(lease.token)
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing
