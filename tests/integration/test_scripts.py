"""Every Lua file loads into a real Redis, and a flushed script cache is recovered from."""

from __future__ import annotations

import asyncio
import hashlib
from importlib.resources import files

import redis
import redis.asyncio as aredis

from celery_leases import _limits, _scripts
from celery_leases._aio import client as aio_client
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._protocol import Script
from celery_leases._sync import client as sync_client
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import resolve_settings
from tests.support.polling import wait_until


def shipped_lua_files() -> dict[str, str]:
    folder = files("celery_leases") / "lua"
    return {
        entry.name.removesuffix(".lua"): entry.read_text(encoding="utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".lua")
    }


def test_every_lua_file_is_a_script_constant():
    shipped = shipped_lua_files()
    assert shipped
    # a file named "_..." is a fragment put into the scripts that use it, not a script
    scripts = {name: src for name, src in shipped.items() if not name.startswith("_")}
    assert set(scripts) == set(_scripts.ALL)
    # the fragments each script has put in after its header, in that order
    fragments = {
        "acquire": ["_lifetime", "_waiters", "_tokens", "_registry"],
        "unique_claim": ["_tokens"],
        "unique_handover": ["_lifetime", "_tokens", "_registry", "_parking"],
        "lifetime_check": ["_lifetime"],
        "release": ["_lifetime", "_waiters", "_tokens"],
        "leave": ["_waiters"],
        **{key: ["_parking"] for key in ("park", "handon", "park_gate", "unpark")},
        "limit": ["_limit"],
        "park_limit": ["_parking", "_limit"],
        "handon_limit": ["_parking", "_limit"],
    }
    for name, source in scripts.items():
        parts = fragments.get(name, [])
        if parts:
            assert _scripts.ALL[name] != source
            put_in = "".join(shipped[part] for part in parts)
            assert _scripts.ALL[name].replace(put_in, "", 1) == source
        else:
            assert _scripts.ALL[name] == source


def test_every_script_has_the_documented_header():
    for name, source in _scripts.ALL.items():
        first = source.splitlines()[0]
        assert first.startswith(f"-- {name}.lua: ")
        assert "KEYS[1]" in source
        assert "returns" in source


def test_script_load_of_every_file(leases_store: LeaseStore, leases_redis: redis.Redis):
    shas = leases_store.load_scripts()
    assert set(shas) == set(_scripts.ALL)
    for name, sha in shas.items():
        assert sha == hashlib.sha1(_scripts.ALL[name].encode()).hexdigest()
    assert leases_redis.script_exists(*shas.values()) == [True] * len(shas)


def test_a_grant_token_text_is_the_clock_in_microseconds(leases_redis: redis.Redis):
    """_tokens.lua puts the text of a token together from TIME's two strings (no format): the
    microseconds are padded to six digits, or a token would read a thousand times too small."""
    probe = shipped_lua_files()["_tokens"] + "\nreturn {clock_of({ARGV[1], ARGV[2]})}"
    for usec in ("0", "7", "4372", "99999", "100000", "999999"):
        ms, us, text = leases_redis.eval(probe, 0, "1796186147", usec)
        assert text == str(1796186147 * 1_000_000 + int(usec))
        assert (ms, us) == (1796186147_000 + int(usec) // 1000, int(text))


def _store_on(url: str, prefix: str) -> LeaseStore:
    return LeaseStore(resolve_settings(None, redis_url=url, key_prefix=prefix))


def test_acquire_and_release_recover_from_script_flush(make_redis_server):
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url)
    store = _store_on(server.url, "flush")
    ident = Identity("node", "inc", 1)
    try:
        first = store.try_acquire([Want("r1")], ident, 5.0)
        assert isinstance(first, list)
        assert admin.script_flush() is True
        assert admin.script_exists(_scripts.SHA["acquire"]) == [False]

        second = store.try_acquire([Want("r2")], ident, 5.0)

        assert isinstance(second, list)
        assert second[0].token > first[0].token
        assert admin.script_exists(_scripts.SHA["acquire"]) == [True]
        admin.script_flush()
        assert store.release(first + second) == [True, True]
        assert store.holders("r1") == store.holders("r2") == []
    finally:
        store.close()
        admin.close()


def test_renew_recovers_from_script_flush(make_redis_server):
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    store = _store_on(server.url, "flush")
    ident = Identity("node", "inc", 1)
    try:
        held = store.try_acquire([Want("a"), Want("b", "s")], ident, 5.0)
        assert isinstance(held, list)
        # renew once so the pooled connection and the script are warm, then flush
        assert store.renew(held, ident.owner, timeout=2.0) == set()
        admin.script_flush()
        assert admin.script_exists(_scripts.SHA["renew"]) == [False]
        # some of the TTL must have run down, or a renewal could not show: read in the
        # millisecond of the first renewal, the TTL is the ttl itself, and one read a
        # millisecond after the second is one below it (seen in a CI run)
        key = store.keys.exclusive("a")
        before = wait_until(
            lambda: (left := admin.pttl(key)) <= 4_900 and left, 10, "the TTL to run down"
        )

        lost = store.renew(held, ident.owner, timeout=2.0)

        assert lost == set()
        assert admin.script_exists(_scripts.SHA["renew"]) == [True]
        # the renewal really ran: the lease's TTL was pushed back up
        assert admin.pttl(key) > before
        assert [h.owner for h in store.holders("a")] == [ident.owner]
        assert [h.mode for h in store.holders("b")] == ["s"]
    finally:
        store.close()
        admin.close()


def test_renew_recovers_from_script_flush_with_several_slot_groups(make_redis_server):
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url)
    store = LeaseStore(
        resolve_settings(None, redis_url=server.url, key_prefix="flush", slot_groups=8)
    )
    ident = Identity("node", "inc", 1)
    names = [f"res-{i}" for i in range(12)]
    try:
        assert len({store.keys.group_of(n) for n in names}) > 2
        held = store.try_acquire([Want(n) for n in names], ident, 5.0)
        assert isinstance(held, list)
        admin.script_flush()

        assert store.renew(held, ident.owner, timeout=2.0) == set()
        # and a lease that is gone is still reported after the reload
        admin.delete(store.keys.exclusive(names[3]))
        admin.script_flush()
        assert store.renew(held, ident.owner, timeout=2.0) == {3}
    finally:
        store.close()
        admin.close()


def test_a_pipeline_whose_scripts_redis_partly_lost_runs_each_call_once(make_redis_server):
    """Redis refills its script cache one script at a time (after a restart or SCRIPT
    FLUSH): a pipeline may meet NOSCRIPT for one call while another, of a script loaded
    again, ran. Only the refused call is sent again, by both drivers: an admission (or a
    grant) must not run twice. (A grant with a riding limit check was granted twice.)"""
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    store = _store_on(server.url, "partly")
    engine = store.engine
    want = _limits.want("api", "100/s", 1)
    log = engine.keys.limit_keys("api")[0]
    calls = [*_limits.checks(engine, [want]), Script("now", [engine.keys.limit_index(0)], [])]
    try:
        for attempt in (1, 2):  # the sync driver, then the asyncio one
            admin.script_flush()
            admin.script_load(_scripts.SOURCE["limit"])  # loaded again; "now" not yet
            if attempt == 1:
                replies = sync_client.round_trip(admin, calls)
            else:

                async def send() -> list[object]:
                    client = aredis.Redis.from_url(server.url, decode_responses=True)
                    try:
                        return await aio_client.round_trip(client, calls)
                    finally:
                        await client.aclose()

                replies = asyncio.run(send())
            assert len(replies) == 2
            assert admin.zcard(log) == attempt, "the admission ran twice"
            assert admin.script_exists(_scripts.SHA["now"]) == [True]
    finally:
        store.close()
        admin.close()
