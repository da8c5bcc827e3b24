"""Each thread's own connection for grants and releases (``_lanes``): opened on a thread's
first script call, closed when the thread ends and by ``store.close()``. Counted on a private
server, where every connection named ``celery_leases`` is this test's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_leases import Leases
from tests.support.polling import wait_until


def ours(server_url: str) -> int:
    with redis.Redis.from_url(server_url) as admin:
        return sum(1 for c in admin.client_list() if c.get("name") == "celery_leases")


def hold_in_threads(
    leases: Leases, n: int, gate: threading.Event
) -> tuple[list[threading.Thread], threading.Semaphore]:
    """``n`` threads that each hold and release a lease, then wait for ``gate``; the
    semaphore is released once per thread that is done with its lease."""
    done = threading.Semaphore(0)

    def work(i: int) -> None:
        with leases.hold(f"lane:{i}"):
            pass
        done.release()
        gate.wait(30)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, done


def all_done(done: threading.Semaphore, n: int) -> None:
    for _ in range(n):
        assert done.acquire(timeout=10), "a thread did not finish its hold"


def test_a_threads_connection_goes_when_the_thread_ends(
    make_redis_server: Callable[..., Any], make_leases: Callable[..., Leases]
) -> None:
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    with leases.hold("warm"):  # this thread's own, and the pool's
        pass
    before = ours(server.url)
    gate = threading.Event()
    threads, done = hold_in_threads(leases, 3, gate)
    all_done(done, 3)
    assert ours(server.url) == before + 3  # one each, kept while the thread lives
    gate.set()
    for t in threads:
        t.join(10)
    # the three threads' connections are closed with them; the pool's stay
    wait_until(lambda: ours(server.url) <= before, 10, "the threads' connections closed")


def test_store_close_closes_every_threads_connection(
    make_redis_server: Callable[..., Any], make_leases: Callable[..., Leases]
) -> None:
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    gate = threading.Event()
    threads, done = hold_in_threads(leases, 3, gate)
    all_done(done, 3)
    assert ours(server.url) >= 3
    leases.store.close()  # the threads are still alive
    wait_until(lambda: ours(server.url) == 0, 10, "every connection closed")
    gate.set()
    for t in threads:
        t.join(10)
    with leases.hold("after-close"):  # a new connection is made on the next call
        pass


def test_a_connection_the_server_closed_is_made_anew_before_a_call(
    make_redis_server: Callable[..., Any], make_leases: Callable[..., Leases]
) -> None:
    # a grant allows a single attempt: sent on a dead connection, its reply would count as
    # lost and be read back (GET, ZRANGE, SMEMBERS...) before it is sent again
    server = make_redis_server()
    leases = make_leases(redis_url=server.url)
    with leases.hold("first"):
        pass
    with redis.Redis.from_url(server.url) as admin:
        for c in admin.client_list():
            if c.get("name") == "celery_leases":
                admin.client_kill_filter(_id=c["id"])
        admin.config_resetstat()
        with leases.hold("second") as lease:
            assert lease.token > 0
        stats = admin.info("commandstats")
    assert "cmdstat_smembers" not in stats  # no read-back of a lost grant
    assert stats["cmdstat_evalsha"]["calls"] >= 2


def test_a_lane_reads_its_replies_itself_and_stays_in_step_after_an_error_reply(
    make_leases: Callable[..., Leases], monkeypatch: Any
) -> None:
    # on a plain socket with hiredis, a lane call reads the socket itself (_lanes._direct),
    # not through redis-py's read_response: an error reply is raised as redis-py raises it,
    # and the connection stays usable (the reply was read whole)
    from redis.connection import AbstractConnection
    from redis.exceptions import ResponseError

    from celery_leases._protocol import Script

    leases = make_leases()
    store = leases.store
    with leases.hold("direct:warm"):
        pass

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a lane call went through redis-py's read_response")

    monkeypatch.setattr(AbstractConnection, "read_response", refused)
    with pytest.raises(ResponseError):
        store._lanes.send(store.client, Script("acquire", [], []), True)  # no keys: a Lua error
    with leases.hold("direct:after") as lease:
        assert lease.token > 0


def test_the_benchmarks_count_a_lanes_writes(make_leases: Callable[..., Leases]) -> None:
    # bench/_common.py::WriteCounter counts the round trips the engine benchmark reports;
    # a lane writes its calls itself (not through redis-py's send_packed_command)
    from bench._common import WriteCounter

    leases = make_leases()
    with leases.hold("counted:warm"):
        pass
    with WriteCounter() as writes:
        with leases.hold("counted"):
            pass
        assert writes.of_thread() == 2  # the grant and the release
