"""The ACL user documented in docs/redis.md is enough for celery_leases, and no more.

The ``ACL SETUSER`` line is read from the docs page, so the page and this test cannot drift.
"""

from __future__ import annotations

import shlex
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from celery_leases import LeaseBusy, Shared
from celery_leases._lease import Want

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_leases import Leases
    from celery_leases._redis_server import RedisServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "redis.md"


def _documented_lines() -> list[str]:
    lines = [ln.strip() for ln in DOCS.read_text().splitlines()]
    return [ln for ln in lines if ln.startswith("ACL SETUSER celery_leases ")]


@pytest.fixture
def acl_url(make_redis_server: Callable[..., RedisServer]) -> str:
    """A private server with the documented user; its URL, as that user, on database 15."""
    server = make_redis_server()
    admin = redis.Redis.from_url(server.url)
    main, *extra = _documented_lines()
    argv = shlex.split(main)
    assert argv[:4] == ["ACL", "SETUSER", "celery_leases", "on"], main
    admin.execute_command(*argv)
    for line in extra:
        try:
            admin.execute_command(*shlex.split(line))
        except ResponseError as exc:  # CLIENT SETINFO is unknown before Redis 7.2
            if "unknown" not in str(exc).lower():
                raise
    admin.script_flush()  # the user's first calls take the SCRIPT LOAD fallback
    admin.close()
    password = next(a[1:] for a in argv if a.startswith(">"))
    return f"redis://celery_leases:{password}@127.0.0.1:{server.port}/15"


def test_the_documented_user_can_do_everything_the_library_does(
    acl_url: str, make_leases: Callable[..., Leases]
) -> None:
    leases = make_leases(redis_url=acl_url, key_prefix="leases", ttl=0.6)
    store = leases.store
    assert store.ping()

    # hold, renewed past its ttl, and a list with shared members
    with leases.hold("report:42") as lease:
        time.sleep(1.0)
        lease.check()
    with leases.hold(["repo:7", Shared("remote:3"), Shared("api:k", limit=2)]) as held:
        assert [h.resource for h in held] == ["repo:7", "remote:3", "api:k"]
        # a second shared holder, and a limit reached (the scripts' sorted-set paths)
        with leases.hold(Shared("remote:3")), leases.hold(Shared("api:k", limit=2)):
            with pytest.raises(LeaseBusy):
                leases.hold(Shared("api:k", limit=2)).__enter__()
            with pytest.raises(LeaseBusy):
                leases.hold("remote:3").__enter__()

    # a waiter is woken by the release (SUBSCRIBE, PUBLISH, UNSUBSCRIBE)
    def holder() -> None:
        with leases.hold("w:1", ttl=5):
            time.sleep(0.3)

    thread = threading.Thread(target=holder)
    thread.start()
    time.sleep(0.1)
    with leases.hold("w:1", wait=5):
        pass
    thread.join()
    with leases.hold("w:2"), pytest.raises(LeaseBusy), leases.hold("w:2", wait=0.2):
        pass

    # once, receipts
    assert leases.once("analysis:1:input", lambda: {"p": 1}) == {"p": 1}
    assert leases.once("analysis:1:input", lambda: {"p": 2}) == {"p": 1}
    assert leases.receipt("analysis:1:input") == {"p": 1}
    assert leases.forget("analysis:1:input")

    assert set(store.load_scripts()) >= {"acquire", "renew", "release", "commit_receipt"}

    # beat claim
    won, *_ = store.beat_claim("entry", due_ms=None, bucket=1.0, replica="r1", keep=60)
    assert won

    # what the cli reads and writes
    (lease,) = leases.acquire([Want("res:99")], ttl=30)
    owner = lease._held.owner
    assert [h.resource for h in store.holders("res:99")] == ["res:99"]
    registries = store.read_registries([o for o, _ in store.owners()])
    items = [(o, e) for o, entries in registries.items() for e in entries]
    assert any(e.resource == "res:99" for _, e in items)
    assert all(left is not None for left in store.check_entries(items))
    assert store.read_liveness([owner])[owner] is not None
    assert store.node_owners(leases.identity().node)
    store.audit({"resource": "res:99", "by": "test"})
    assert store.audit_log(1)[0]["resource"] == "res:99"
    assert store.reconcile().errors == []

    # start-up cleanup: frees every lease of the node's other incarnations
    report = store.cleanup_node(leases.identity().node, keep_incarnation="another")
    assert report.errors == []
    assert "res:99" in {r for _, r in report.released}
    assert store.holders("res:99") == []
    leases.release([lease])  # already freed: a no-op


def test_the_documented_user_is_refused_everything_else(acl_url: str) -> None:
    client = redis.Redis.from_url(acl_url)
    try:
        with pytest.raises(NoPermissionError):
            client.flushall()
        with pytest.raises(NoPermissionError):
            client.get("other:key")
        with pytest.raises(NoPermissionError):
            client.set("{other:0}:x:res", "1")
        with pytest.raises(NoPermissionError):
            client.publish("other-channel", "x")
        with pytest.raises(NoPermissionError):
            client.keys("*")
        # EVAL is allowed, but a script can do no more than its caller
        with pytest.raises(NoPermissionError):
            client.eval("return redis.call('GET', KEYS[1])", 1, "other:key")
        with pytest.raises(redis.ResponseError, match=r"permission|can't run"):
            client.eval("return redis.call('FLUSHALL')", 0)
        with pytest.raises(redis.ResponseError, match="can't access"):
            client.eval("return redis.call('GET', 'other:key')", 0)
        assert client.get("{leases:0}:x:free") is None  # inside the prefix: allowed
    finally:
        client.close()
