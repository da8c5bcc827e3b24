"""Resource names are user data: any text is its own lease, and its keys stay in the prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_leases import LeaseBusy, LeaseConfigError, Leases, Shared
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import MAX_NAME_BYTES, Want
from tests.support.cluster import hash_tag

NAMES = [
    "plain",
    "a:b",
    "a:b:",
    ":a:b",
    "a",
    "{a}",
    "%7Ba%7D",
    "%257Ba%257D",
    "}{",
    "%7D%7B",
    "{",
    "}",
    "a b",
    "a%20b",
    "a  b",
    "a\nb",
    "a%0Ab",
    "a\r\nb",
    "a\tb",
    " a",
    "a ",
    "ключ",
    "锁🔒",
    "é",
    "e\u0301",
    "x" * MAX_NAME_BYTES,  # the longest a name may be
    "x" * (MAX_NAME_BYTES - 1),
    "é" * (MAX_NAME_BYTES // 2),  # counted in bytes of UTF-8: 512 characters
    "%",
    "%%",
    "x:1}:x:a",
    "{leases:0}:x:a",
]


def test_the_names_are_distinct():
    assert len(set(NAMES)) == len(NAMES)


def test_every_name_is_its_own_lease(leases: Leases):
    # all at once: if two names shared a key, the list would be busy with itself
    with leases.hold(NAMES, ttl=10) as got:
        assert [lease.resource for lease in got] == NAMES
        for name in NAMES:
            (holder,) = leases.store.holders(name)
            assert holder.resource == name
            with pytest.raises(LeaseBusy) as info, leases.hold(name):
                pass
            assert info.value.resource == name
    for name in NAMES:
        assert leases.store.holders(name) == []


@pytest.mark.parametrize("name", NAMES, ids=range(len(NAMES)))
def test_holding_one_name_leaves_every_other_free(leases: Leases, name: str):
    rival = Identity("rival", "inc", 1)
    others = [Want(n) for n in NAMES if n != name]
    with leases.hold(name, ttl=10):
        got = leases.store.try_acquire(others, rival, 10.0)
        assert isinstance(got, list)
        leases.store.release(got)
        assert isinstance(leases.store.try_acquire([Want(name)], rival, 10.0), Busy)


def test_names_round_trip_through_the_registry(leases: Leases):
    store = leases.store
    owner = leases.identity().owner
    with leases.hold([*NAMES[:-3], Shared(NAMES[-1])], ttl=10):
        owned = store.owned(owner)
        assert sorted(resource for _, _, resource in owned) == sorted([*NAMES[:-3], NAMES[-1]])
    report = store.cleanup_owner(owner)
    assert report.kept == []
    assert report.released == []  # all were released on leaving the block


def test_every_key_lives_under_the_prefix_hash_tag(make_redis_server):
    server = make_redis_server()
    prefixes = ["names", "names:1"]
    made = [
        Leases(Celery(f"names-{p}", set_as_current=False), redis_url=server.url, key_prefix=p)
        for p in prefixes
    ]
    grouped = Leases(
        Celery("names-grouped", set_as_current=False),
        redis_url=server.url,
        key_prefix="grouped",
        slot_groups=8,
    )
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        for leases in made:
            with leases.hold(NAMES, ttl=10), leases.hold(Shared("shared {x}"), ttl=10):
                pass
            store = leases.store
            store.cleanup_owner(leases.identity().owner)
            with leases.hold(NAMES[:5], ttl=10):
                pass
        with grouped.hold(NAMES, ttl=10):
            keys = client.keys("*")
        allowed = {f"{p}:0" for p in prefixes} | {f"grouped:{g}" for g in range(8)}
        assert keys
        for key in keys:
            assert key.startswith("{"), key
            assert hash_tag(key) in allowed, key
        grouped_tags = {hash_tag(k) for k in keys if k.startswith("{grouped:")}
        assert len(grouped_tags) > 2  # the slot groups really were used
    finally:
        client.close()
        for leases in [*made, grouped]:
            leases.store.close()


@pytest.mark.parametrize("name", ["a\ud800b", "\udfff"])
def test_a_name_without_a_utf8_form_is_a_config_error(leases: Leases, name: str):
    # not a raw UnicodeEncodeError from redis-py: the public API raises LeaseError kinds only
    with pytest.raises(LeaseConfigError, match="UTF-8"), leases.hold(name):
        pass
    with pytest.raises(LeaseConfigError), leases.hold(Shared(name)):
        pass


# --- a bounded size ---------------------------------------------------------------------------
LONG = "x" * 1_000_000


def _entered(block: Any) -> None:
    with block:
        pass


async def _aentered(block: Any) -> None:
    async with block:
        pass


#: each way a name reaches the library, with a name too long: (the call, what the error names)
REFUSED: dict[str, tuple[Callable[[Leases], Any], str]] = {
    "hold": (lambda ls: _entered(ls.hold(LONG)), "hold(resource)"),
    "hold-shared": (lambda ls: _entered(ls.hold(Shared(LONG, limit=3))), "hold(resource)"),
    "hold-list": (lambda ls: _entered(ls.hold(["free", LONG])), "hold(resource[1])"),
    "hold-at-the-limit-plus-one": (
        lambda ls: _entered(ls.hold("é" * (MAX_NAME_BYTES // 2) + "x")),
        "1,025 bytes",
    ),
    "once": (lambda ls: ls.once(LONG, lambda: 1), "the once name"),
    "receipt": (lambda ls: ls.receipt(LONG), "the once name"),
    "forget": (lambda ls: ls.forget(LONG), "the once name"),
    "ahold": (lambda ls: asyncio.run(_aentered(ls.ahold(LONG))), "ahold(resource)"),
    "ahold-list": (
        lambda ls: asyncio.run(_aentered(ls.ahold(["free", Shared(LONG)]))),
        "ahold(resource[1])",
    ),
    "aonce": (lambda ls: asyncio.run(ls.aonce(LONG, lambda: 1)), "the once name"),
    "areceipt": (lambda ls: asyncio.run(ls.areceipt(LONG)), "the once name"),
    "aforget": (lambda ls: asyncio.run(ls.aforget(LONG)), "the once name"),
}


def _sent(admin: redis.Redis) -> tuple[int, dict[str, int]]:
    """Connections the server took, and its calls of each command but the test's INFO."""
    stats = admin.info("commandstats")
    calls = {k: int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"}
    return int(admin.info("stats")["total_connections_received"]), calls


@pytest.mark.parametrize("entry", list(REFUSED))
def test_a_name_too_long_is_refused_and_nothing_is_sent(
    make_leases: Callable[..., Leases], make_redis_server: Any, entry: str
):
    """``hold("x" * 1_000_000)`` left a token counter key of 1 MB for 24 h (issue 26, part 5):
    refused before anything is sent, not even a connection made."""
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    leases = make_leases(redis_url=server.url)
    call, named = REFUSED[entry]
    try:
        before = _sent(admin)
        with pytest.raises(LeaseConfigError) as info:
            call(leases)
        text = str(info.value)
        assert named in text
        assert f"at most {MAX_NAME_BYTES:,} bytes" in text
        assert len(text) < 400  # names its start, not the whole name
        assert _sent(admin) == before
        assert admin.dbsize() == 0
    finally:
        admin.close()


def test_a_name_at_the_limit_counts_bytes_and_leaves_no_long_key(
    leases: Leases, leases_redis: redis.Redis
):
    name = "é" * (MAX_NAME_BYTES // 2)  # 512 characters, 1,024 bytes
    with leases.hold(name, ttl=10) as lease:
        assert lease.resource == name
    with pytest.raises(LeaseConfigError, match="1,025 bytes"), leases.hold(name + "x"):
        pass
    with pytest.raises(LeaseConfigError, match="1,025 bytes"), leases.hold("y" * 1025):
        pass
    assert leases.store.holders("y" * 1025) == []
    # a once name is bounded alone: the library's own prefix (celery_leases:once:) is not counted
    assert leases.once("o" * MAX_NAME_BYTES, lambda: 7) == 7
    assert leases.receipt("o" * MAX_NAME_BYTES) == 7
    assert leases.forget("o" * MAX_NAME_BYTES)
