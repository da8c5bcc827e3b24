"""The leases' Redis stops answering while a leased task runs (SIGSTOP of a private server).

Broker and result backend stay on the shared test Redis; only the leases live on the private
server. Frozen for longer than the TTL, it cannot confirm the lease: the body must get
``LeaseLost`` before Redis could hand the lease to anyone else, the worker must live on, and
once Redis answers again the next leased task must run normally.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_leases.exceptions import LeaseBackendError

from .conftest import wait_until

pytestmark = pytest.mark.worker

TTL = 2.0


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 1), ("threads", 2)])
def test_redis_frozen_past_the_ttl_interrupts_the_body_and_the_worker_recovers(
    pool: str,
    concurrency: int,
    start_worker: Any,
    make_redis_server: Any,
    make_leases: Any,
    worker_app: Any,
    send: Any,
    ledger: Any,
) -> None:
    server = make_redis_server()
    store = make_leases(redis_url=server.url, ttl=TTL).store
    worker = start_worker(
        pool, concurrency, env={"CELERY_LEASES_REDIS_URL": server.url, "CELERY_LEASES_TTL": "2"}
    )
    processes = worker.children() if pool == "prefork" else []
    rid = f"frozen-{pool}"
    resource = f"res:{rid}"
    result = send(worker_app.interrupted, rid, 60)
    ledger.wait_event(f"started:{rid}")
    (held,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    assert held.node == worker.hostname

    server.pause()
    paused_at = time.monotonic()
    try:
        wait_until(
            lambda: ledger.events(f"lost:{rid}"),
            6 * TTL,
            f"LeaseLost in the body of interrupted({rid!r}) while Redis is frozen",
        )
        told_after = time.monotonic() - paused_at
        # stay frozen for longer than the TTL
        wait_until(lambda: time.monotonic() - paused_at > 1.5 * TTL, 2 * TTL, "the freeze")
    finally:
        server.resume()
    assert ledger.events(f"lost:{rid}") == [resource]
    # the body was told before Redis could have expired the lease (its last renewal was
    # before the freeze), so before anyone else could be granted it
    assert told_after < TTL
    assert result.get(timeout=30) == f"lost:{resource}"

    # the worker lived through it (prefork: the same pool process, not a replacement)
    assert worker.proc is not None
    assert worker.proc.poll() is None
    if pool == "prefork":
        assert worker.children() == processes

    # Redis answers again: the lease is gone (released, or run out) and the next task runs
    wait_until(lambda: store.holders(resource) == [], 3 * TTL, f"{resource} to be free")
    after = send(worker_app.guarded, rid).get(timeout=30)
    assert after["leases"][0][0] == resource
    assert after["leases"][0][1] > held.token
    assert ledger.overlaps() == 0
    log = worker.log()
    assert f"leases: lost {resource}" in log
    assert "Traceback" not in log.split("leases: lost", 1)[1]


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_redis_unreachable_as_a_task_takes_its_lease(
    policy: str,
    start_worker: Any,
    make_redis_server: Any,
    make_leases: Any,
    worker_app: Any,
    send: Any,
    ledger: Any,
) -> None:
    """on_backend_error: "retry" retries the task (it runs once Redis answers), "fail" fails
    it with LeaseBackendError; in neither case does the body run without its lease."""
    server = make_redis_server()
    store = make_leases(redis_url=server.url).store
    worker = start_worker(
        "prefork",
        1,
        env={
            "CELERY_LEASES_REDIS_URL": server.url,
            "CELERY_LEASES_SOCKET_TIMEOUT": "0.5",
            "CELERY_LEASES_RETRY_DELAY": "0.2",
            "CELERY_LEASES_RETRY_MAX_DELAY": "0.4",
            "CELERY_LEASES_ON_BACKEND_ERROR": policy,
        },
    )
    rid = f"unreachable-{policy}"
    resource = f"res:{rid}"
    refused = "Redis failed as it took its leases"
    server.pause()
    try:
        result = send(worker_app.guarded, rid)
        if policy == "retry":
            wait_until(lambda: refused in worker.log(), 30, "the task's retry")
        else:
            result.get(timeout=30, propagate=False)
    finally:
        server.resume()

    if policy == "fail":
        assert result.state == "FAILURE"
        assert isinstance(result.result, LeaseBackendError), repr(result.result)
        assert refused not in worker.log()
        assert ledger.runs() == 0
        return
    done = result.get(timeout=30)
    assert done["leases"][0][0] == resource
    assert ledger.runs() == 1
    # it ran under a lease that Redis granted, and gave it back
    assert store.holders(resource) == []
    assert "retries in" in worker.log()
