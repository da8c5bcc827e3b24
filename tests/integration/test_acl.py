"""The ACL user documented in docs/security.md is enough for celery_leases, and no more.

The ``ACL SETUSER`` lines are read from the docs page, so the page and this test cannot drift.
tests/integration/worker/test_security.py runs a real worker, the CLI and beat as that user
and shows that every command the line allows is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis
from redis.exceptions import NoPermissionError

from celery_leases import LeaseBackendError, Leases
from celery_leases._redis_server import RedisServer
from tests.integration.tour import TOUR_TTL, tour
from tests.support.acl import USER, allowed_commands, create_documented_user


@pytest.fixture
def acl_server(make_redis_server: Callable[..., RedisServer]) -> RedisServer:
    """A private server (ACL SETUSER never runs on the shared one), DEBUG on for its admin."""
    return make_redis_server(extra_args=["--enable-debug-command", "yes"])


def _user_url(server: RedisServer, password: str) -> str:
    return f"redis://{USER}:{password}@127.0.0.1:{server.port}/15"


@pytest.mark.parametrize("key_pattern", [None, "{leases:0}*"], ids=["documented", "tighter"])
def test_the_documented_user_can_do_everything_the_library_does(
    acl_server: RedisServer, make_leases: Callable[..., Leases], key_pattern: str | None
) -> None:
    admin = redis.Redis.from_url(acl_server.url)
    password = create_documented_user(admin, key_pattern=key_pattern)
    admin.script_flush()  # the user's first calls take the SCRIPT LOAD fallback
    leases = make_leases(
        redis_url=_user_url(acl_server, password), key_prefix="leases", ttl=TOUR_TTL
    )
    tour(leases)
    assert admin.acl_log() == []  # nothing was refused on the way
    admin.close()


def test_the_documented_user_is_refused_everything_else(acl_server: RedisServer) -> None:
    admin = redis.Redis.from_url(acl_server.url)
    password = create_documented_user(admin)
    assert "auth" not in allowed_commands(admin)  # logging in needs no rule
    other = admin.script_load("return redis.call('GET', KEYS[1])")
    admin.close()
    client = redis.Redis.from_url(_user_url(acl_server, password))
    try:
        assert client.ping()
        refused: list[tuple[str, Callable[[], object]]] = [
            ("FLUSHALL", client.flushall),
            ("FLUSHDB", client.flushdb),
            ("KEYS", lambda: client.keys("*")),
            ("SCAN", lambda: client.scan(0)),
            ("CONFIG GET", lambda: client.config_get("*")),
            ("CONFIG SET", lambda: client.config_set("maxmemory", "1")),
            ("CLIENT LIST", client.client_list),
            ("CLIENT KILL", lambda: client.client_kill_filter(skipme=False)),
            ("DEBUG", lambda: client.execute_command("DEBUG", "SLEEP", "0")),
            ("EVAL", lambda: client.eval("return 1", 0)),
            ("SCRIPT FLUSH", client.script_flush),
            ("ACL LIST", client.acl_list),
            ("MONITOR", lambda: client.execute_command("MONITOR")),
            ("GET outside the prefix", lambda: client.get("other:key")),
            ("SET outside the prefix", lambda: client.set("{other:0}:x:res", "1")),
            ("DEL outside the prefix", lambda: client.delete("other:key")),
            ("PUBLISH outside the prefix", lambda: client.publish("other-channel", "x")),
            # a script runs with its caller's permissions: SCRIPT LOAD opens no back door
            ("EVALSHA reaching outside", lambda: client.evalsha(other, 1, "other:key")),
        ]
        pubsub = client.pubsub()  # a refusal arrives as the reply read after the request
        refused += [
            (
                "SUBSCRIBE outside the prefix",
                lambda: (pubsub.subscribe("other-channel"), pubsub.get_message(timeout=5)),
            ),
            (
                "PSUBSCRIBE",
                lambda: (pubsub.psubscribe("{leases:*"), pubsub.get_message(timeout=5)),
            ),
        ]
        assert [what for what, call in refused if not _refused(call)] == []
        pubsub.close()
        assert client.get("{leases:0}:x:free") is None  # inside the prefix: allowed
    finally:
        client.close()


def _refused(call: Callable[[], object]) -> bool:
    """True if ``call`` fails for want of permission (NOPERM)."""
    try:
        call()
    except NoPermissionError as exc:
        return "permission" in str(exc)
    return False


def test_a_library_store_as_the_user_gets_a_backend_error_outside_its_prefix(
    acl_server: RedisServer, make_leases: Callable[..., Leases]
) -> None:
    admin = redis.Redis.from_url(acl_server.url)
    password = create_documented_user(admin)
    admin.close()
    leases = make_leases(redis_url=_user_url(acl_server, password), key_prefix="other")
    with pytest.raises(LeaseBackendError, match="permission"), leases.hold("x"):
        pass


@pytest.mark.parametrize("api", ["sync", "asyncio"])
def test_a_request_that_redis_fails_in_a_later_slot_group_gives_back_the_earlier_ones(
    api: str, acl_server: RedisServer, make_leases: Callable[..., Leases]
) -> None:
    # the user may touch slot group 0 only: a request spanning groups 0 and k is granted in
    # group 0, then refused (NOPERM) in group k; the grant in group 0 must not stay behind
    admin = redis.Redis.from_url(acl_server.url)
    password = create_documented_user(admin, key_pattern="{leases:0}*")
    admin.close()
    user = make_leases(
        redis_url=_user_url(acl_server, password), key_prefix="leases", slot_groups=8
    )
    inspector = make_leases(
        redis_url=f"redis://127.0.0.1:{acl_server.port}/15", key_prefix="leases", slot_groups=8
    ).store
    keys = user.store.keys
    first = next(f"r{i}" for i in range(100) if keys.group_of(f"r{i}") == 0)
    later = next(f"r{i}" for i in range(100) if keys.group_of(f"r{i}") != 0)

    async def ahold() -> None:
        try:
            async with user.ahold([first, later]):
                pass
        finally:
            await user.aclose()

    def hold() -> None:
        with user.hold([first, later]):
            pass

    with pytest.raises(LeaseBackendError, match="permission"):
        hold() if api == "sync" else asyncio.run(ahold())
    # the grant in group 0 went through before the refusal (the registration stays: it is
    # the owner's, not the request's)
    assert inspector.node_owners(user.identity().node) == [user.identity().owner]
    assert inspector.holders(first) == []
    assert inspector.entries(user.identity().owner) == []
