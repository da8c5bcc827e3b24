"""The lease lifecycle under the gevent and eventlet pools, in real workers.

Start-up cleanup, heartbeat renewals past the TTL, the interrupt of a body whose lease is
lost, and the release on success, failure, ``self.retry``, ``revoke(terminate=True)`` and (gevent:
Celery's eventlet pool enforces none) the hard time limit.
Under both pools every task is a greenlet of the worker's one process, and the heartbeat a
greenlet too (Celery monkey-patches the process before it imports the app).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from .conftest import kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0
WORKER_TTL = 3.0  # CELERY_LEASES_TTL of the worker_env fixture
LONG_TTL_ENV = {"CELERY_LEASES_TTL": "60"}
POOLS = ["gevent", "eventlet"]


def held_by(test_leases: Any, worker: Any, resource: str) -> Any:
    def held() -> Any:
        holders = test_leases.store.holders(resource)
        return holders if holders and holders[0].node == worker.hostname else None

    (holder,) = wait_until(held, RESULT_TIMEOUT, f"{worker.hostname} to hold {resource}")
    return holder


@pytest.mark.parametrize("pool", POOLS)
def test_renewals_interrupt_and_release(
    pool: str, start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any,
    leases_redis: Any,
) -> None:  # fmt: skip
    worker = start_worker(pool, 4)
    # renewed past the TTL: three TTLs in the body, the same grant all along
    long = send(worker_app.guarded, f"{pool}-long", 3 * WORKER_TTL)
    first = held_by(test_leases, worker, f"res:{pool}-long")
    out = long.get(timeout=RESULT_TIMEOUT)
    assert out["leases"] == [[f"res:{pool}-long", first.token]]
    assert ledger.overlaps() == 0
    assert test_leases.store.holders(f"res:{pool}-long") == []

    # interrupt: LeaseLost arrives inside the body, in the task's own greenlet
    lost = send(worker_app.interrupted, f"{pool}-gone", 30.0)
    ledger.wait_event(f"started:{pool}-gone")
    held_by(test_leases, worker, f"res:{pool}-gone")
    deleted = time.monotonic()
    assert leases_redis.delete(test_leases.store.keys.exclusive(f"res:{pool}-gone")) == 1
    assert lost.get(timeout=RESULT_TIMEOUT) == f"lost:res:{pool}-gone"
    assert time.monotonic() - deleted < 2 * WORKER_TTL

    # release on success, failure and self.retry
    assert send(worker_app.guarded, f"{pool}-ok", 0.1).get(timeout=RESULT_TIMEOUT)["leases"]
    failed = send(worker_app.fails, f"{pool}-exc")
    failed.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert failed.state == "FAILURE"
    retried = send(worker_app.retry_in_body, f"{pool}-retry", 1.0)
    assert retried.get(timeout=RESULT_TIMEOUT)["leases"][0][0] == f"res:{pool}-retry"
    for rid in ("ok", "exc", "retry", "gone"):
        assert test_leases.store.holders(f"res:{pool}-{rid}") == [], rid
    # the only ERROR is the failing task's own; nothing of ours, nothing unrecoverable
    errors = [line for line in worker.log().splitlines() if "ERROR/" in line]
    assert all(f"fails[{failed.id}]" in line for line in errors), errors


@pytest.mark.parametrize("pool", POOLS)
def test_revoke_terminate_releases(
    pool: str, start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    worker = start_worker(pool, 4, env=LONG_TTL_ENV)
    result = send(worker_app.sleeper, f"{pool}-rv", 30.0)
    ledger.wait_event(f"started:{pool}-rv")
    held_by(test_leases, worker, f"res:{pool}-rv")
    result.revoke(terminate=True)
    wait_until(
        lambda: test_leases.store.holders(f"res:{pool}-rv") == [],
        15,
        f"res:{pool}-rv to be released after revoke(terminate=True)",
    )
    if pool == "gevent":  # Celery's eventlet pool enforces no time limit at all
        # the hard time limit: the pool raises its Timeout inside the greenlet
        limited = send(worker_app.hard_limited, f"{pool}-hard")
        held_by(test_leases, worker, f"res:{pool}-hard")
        limited.get(timeout=RESULT_TIMEOUT, propagate=False)
        assert limited.state == "FAILURE"
        wait_until(
            lambda: test_leases.store.holders(f"res:{pool}-hard") == [],
            15,
            f"res:{pool}-hard to be released after the hard time limit",
        )
    # the worker still works
    assert send(worker_app.guarded, f"{pool}-rv", 0.1).get(timeout=RESULT_TIMEOUT)["leases"]


@pytest.mark.parametrize("pool", POOLS)
def test_startup_cleanup_frees_a_killed_incarnation(
    pool: str, start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    worker = start_worker(pool, 2, env=LONG_TTL_ENV)
    send(worker_app.sleeper, f"{pool}-restart", 120.0)
    ledger.wait_event(f"started:{pool}-restart")
    held_by(test_leases, worker, f"res:{pool}-restart")
    kill_whole_worker(worker)
    assert test_leases.store.holders(f"res:{pool}-restart"), "the lease went with the worker"
    worker.start()  # same name: "ready." comes after the start-up cleanup
    assert test_leases.store.holders(f"res:{pool}-restart") == []
    assert "start-up cleanup of earlier incarnations" in worker.current_log()
