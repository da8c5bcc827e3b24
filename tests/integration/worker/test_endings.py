"""Every way a leased task can end, in real workers: the lease must come back each time.

Success, an exception, ``self.retry`` and the soft time limit release in the task's own
``finally``, before the result is stored, so the lease is free as soon as the result is there.
Ends that kill the pool child (hard time limit, ``revoke(terminate=True)``, kill -9) run with a
60 s TTL: the lease must come back well before it could have expired.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from .conftest import wait_until

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0
WORKER_TTL = 3.0  # CELERY_LEASES_TTL of the worker_env fixture
LONG_TTL = 60.0
LONG_TTL_ENV = {"CELERY_LEASES_TTL": str(int(LONG_TTL))}


def owners_of(test_leases, worker) -> list[str]:
    return test_leases.store.node_owners(worker.hostname)


def registry_entries(test_leases, worker, pid: int | None = None) -> list[tuple[str, int, str]]:
    """What the registries of the worker's owners (or of its process ``pid``) still list."""
    owners = owners_of(test_leases, worker)
    if pid is not None:
        owners = [o for o in owners if o.endswith(f"/{pid}")]
    return [e for o in owners for e in test_leases.store.owned(o)]


def wait_forgotten(test_leases, worker, pid: int) -> None:
    """Wait until the owner of the dead process ``pid`` is no longer listed under its node."""
    wait_until(
        lambda: not [o for o in owners_of(test_leases, worker) if o.endswith(f"/{pid}")],
        LONG_TTL / 4,
        f"the owner of dead process {pid} to be forgotten",
    )


def hold_by_worker(test_leases, worker, resource: str, min_expires_in: float = 0.0):
    """Wait until a process of ``worker`` holds ``resource``; return the holder."""

    def held():
        holders = test_leases.store.holders(resource)
        return holders if holders and holders[0].node == worker.hostname else None

    (holder,) = wait_until(held, RESULT_TIMEOUT, f"{worker.hostname} to hold {resource}")
    assert holder.expires_in > min_expires_in, holder
    return holder


# --- released in the task's own finally ---------------------------------------------------------
def test_released_after_success_exception_and_retry_in_body(
    start_worker, worker_app, send, test_leases, ledger
):
    worker = start_worker("prefork", 2)

    out = send(worker_app.guarded, "ok", 0.1).get(timeout=RESULT_TIMEOUT)
    assert [r for r, _ in out["leases"]] == ["res:ok"]
    assert test_leases.store.holders("res:ok") == []
    assert owners_of(test_leases, worker), "the worker registered no owner"
    assert registry_entries(test_leases, worker) == []

    result = send(worker_app.fails, "exc")
    result.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, ValueError)
    assert test_leases.store.holders("res:exc") == []
    assert registry_entries(test_leases, worker) == []

    countdown = 3.0
    result = send(worker_app.retry_in_body, "rb", countdown)
    wait_until(lambda: result.state == "RETRY", RESULT_TIMEOUT, "state RETRY")
    # the retry is pending: the lease must already be free
    assert test_leases.store.holders("res:rb") == []
    checked_at = time.time()
    (first,) = ledger.events("retry_in_body:rb")
    first_retries, first_at = first.split(":")
    assert first_retries == "0"
    assert checked_at < float(first_at) + countdown, "checked too late: the countdown had run out"
    out = result.get(timeout=RESULT_TIMEOUT)
    assert [r for r, _ in out["leases"]] == ["res:rb"]
    second = ledger.events("retry_in_body:rb")[1]
    assert second.startswith("1:")
    assert float(second.split(":")[1]) >= float(first_at) + countdown
    assert test_leases.store.holders("res:rb") == []
    assert registry_entries(test_leases, worker) == []
    assert ledger.overlaps() == 0


def test_released_after_soft_time_limit(start_worker, worker_app, send, test_leases, ledger):
    start_worker("prefork", 2)
    result = send(worker_app.soft_limited, "soft")
    result.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, SoftTimeLimitExceeded)
    assert ledger.events("soft:soft") == ["caught"]
    assert test_leases.store.holders("res:soft") == []


# --- the pool child is killed: 60 s TTL, the lease must come back long before ---------------------
def test_released_after_hard_time_limit(start_worker, worker_app, send, test_leases):
    worker = start_worker("prefork", 2, env=LONG_TTL_ENV)
    result = send(worker_app.hard_limited, "hard")
    hold_by_worker(test_leases, worker, "res:hard", min_expires_in=WORKER_TTL)
    result.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, TimeLimitExceeded)
    wait_until(
        lambda: test_leases.store.holders("res:hard") == [],
        LONG_TTL / 4,
        "res:hard to be released after the hard time limit",
    )
    wait_until(
        lambda: registry_entries(test_leases, worker) == [],
        LONG_TTL / 4,
        "the killed child's registry to be emptied",
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_released_after_revoke_terminate(start_worker, worker_app, send, test_leases, ledger, sig):
    worker = start_worker("prefork", 2, env=LONG_TTL_ENV)
    result = send(worker_app.sleeper, "rv", 30.0)
    child = int(ledger.wait_event("started:rv"))
    hold_by_worker(test_leases, worker, "res:rv", min_expires_in=WORKER_TTL)
    result.revoke(terminate=True, signal=sig)
    wait_until(lambda: result.state == "REVOKED", RESULT_TIMEOUT, "state REVOKED")
    wait_until(
        lambda: test_leases.store.holders("res:rv") == [],
        LONG_TTL / 4,
        f"res:rv to be released after revoke(terminate=True, signal={sig})",
    )
    assert registry_entries(test_leases, worker, child) == []
    if sig == "SIGKILL":
        # nothing ran in the child: only the main process can have freed it
        assert "reaper (dead pool process) released 1 lease(s): res:rv" in worker.log()
        wait_forgotten(test_leases, worker, child)


def test_kill_9_of_a_child_redelivers_late_task_without_overlap(
    start_worker, worker_app, send, test_leases, ledger, leases_redis
):
    worker = start_worker("prefork", 2, env=LONG_TTL_ENV)
    result = send(worker_app.late, "late", 2.0)
    victim = int(ledger.wait_event("started:late"))
    wait_until(lambda: ledger.tokens("res:late"), RESULT_TIMEOUT, "the first run to enter")
    hold_by_worker(test_leases, worker, "res:late", min_expires_in=WORKER_TTL)
    # the killed run cannot leave the ledger; leave for it now, while it still holds the lease
    # and nothing else can be inside, so that a later run overlapping it would still count
    leases_redis.decr(ledger.key("active", "res:late"))
    os.kill(victim, signal.SIGKILL)

    out = result.get(timeout=LONG_TTL / 2)
    assert out["pid"] != victim
    assert [int(p) for p in ledger.events("started:late")] == [victim, out["pid"]]
    assert ledger.overlaps() == 0
    first, second = ledger.tokens("res:late")
    assert second > first
    assert out["leases"] == [["res:late", second]]
    assert test_leases.store.holders("res:late") == []
    assert registry_entries(test_leases, worker, victim) == []
    wait_forgotten(test_leases, worker, victim)


# --- on_lost ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 2), ("threads", 2), ("solo", 1)])
def test_on_lost_interrupt_raises_lease_lost_in_the_body(
    start_worker, worker_app, send, test_leases, ledger, leases_redis, pool, concurrency
):
    worker = start_worker(pool, concurrency)
    result = send(worker_app.interrupted, "gone", 30.0)
    ledger.wait_event("started:gone")
    hold_by_worker(test_leases, worker, "res:gone")
    deleted = time.monotonic()
    assert leases_redis.delete(test_leases.store.keys.exclusive("res:gone")) == 1
    assert result.get(timeout=RESULT_TIMEOUT) == "lost:res:gone"
    noticed = time.monotonic() - deleted
    assert noticed < 2 * WORKER_TTL, f"the body learned {noticed:.1f}s after the key was gone"
    assert ledger.events("lost:gone") == ["res:gone"]
    assert registry_entries(test_leases, worker) == []
    # the worker is still sound: the interrupt did not leak into the next task
    out = send(worker_app.guarded, "gone", 0.3).get(timeout=RESULT_TIMEOUT)
    assert [r for r, _ in out["leases"]] == ["res:gone"]
    assert test_leases.store.holders("res:gone") == []


def test_on_lost_log_finishes_and_logs_a_warning(
    start_worker, worker_app, send, test_leases, ledger, leases_redis
):
    worker = start_worker("prefork", 2)
    result = send(worker_app.logged, "logged", 3.0)
    ledger.wait_event("started:logged")
    hold_by_worker(test_leases, worker, "res:logged")
    assert leases_redis.delete(test_leases.store.keys.exclusive("res:logged")) == 1
    assert result.get(timeout=RESULT_TIMEOUT) == "finished"
    lines = [line for line in worker.log().splitlines() if "leases: lost res:logged" in line]
    assert lines, "no 'lost' line in the worker log"
    assert all("WARNING" in line for line in lines), lines
    assert registry_entries(test_leases, worker) == []


# --- warm shutdown ------------------------------------------------------------------------------
def test_warm_shutdown_leaves_no_owner_of_the_node(start_worker, worker_app, send, test_leases):
    worker = start_worker("prefork", 2)
    results = [send(worker_app.guarded, f"w{i}", 0.3) for i in range(4)]
    for result in results:
        result.get(timeout=RESULT_TIMEOUT)
    assert owners_of(test_leases, worker), "the tasks registered no owner"
    assert worker.stop(signal.SIGTERM) == 0
    assert owners_of(test_leases, worker) == []
    assert not [o for o, _ in test_leases.store.owners() if worker.hostname in o]
    assert worker.hostname not in test_leases.store.nodes()
