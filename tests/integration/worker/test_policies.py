"""Busy policies of LeasedTask in real workers: skip, fail, wait and retry.

The test process holds the resource (``test_leases.hold``) while a worker runs the task, so
the task always finds it busy; what the task does then is the policy under test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_leases import LeaseBusy, Leases, is_skipped
from celery_leases.task import BUSY_ATTEMPT_HEADER, BUSY_SINCE_HEADER

from .conftest import WorkerProc, wait_until

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0
#: TTL of the test's own hold where a waiter's wake-up time matters: a waiter that were not
#: woken by the release would sleep until about this long after its last attempt
LONG_HOLD_TTL = 20.0


@dataclass
class Ctx:
    """What the policy checks need."""

    worker_app: ModuleType
    send: Any
    test_leases: Leases
    ledger: Any
    redis: redis.Redis
    worker: WorkerProc

    def waiters(self, resource: str) -> int:
        """Clients subscribed to ``resource``'s release channel (a task in on_busy="wait")."""
        channel = self.test_leases.store.keys.channel(resource)
        return int(dict(self.redis.pubsub_numsub(channel)).get(channel, 0))

    def busy_retries(self, task_id: str) -> int:
        """How many times the worker logged a busy retry of ``task_id``."""
        return self.worker.log().count(f"[{task_id}] retry: retrying in")


@pytest.fixture
def ctx(worker_app, send, test_leases, ledger, leases_redis) -> Any:
    def make(worker: WorkerProc) -> Ctx:
        return Ctx(worker_app, send, test_leases, ledger, leases_redis, worker)

    return make


# --- the checks, shared by the per-pool tests -------------------------------------------------
def check_skip(c: Ctx, rid: str) -> None:
    resource = f"res:{rid}"
    runs_before = c.ledger.runs()
    with c.test_leases.hold(resource, ttl=LONG_HOLD_TTL):
        result = c.send(c.worker_app.busy_skip, rid, 0.0)
        assert is_skipped(result.get(timeout=RESULT_TIMEOUT))
        assert result.state == "SUCCESS"
        # the test still holds it: the skipped task neither ran nor took anything
        assert [h.owner for h in c.test_leases.store.holders(resource)] == [
            c.test_leases.identity().owner
        ]
    assert c.ledger.runs() == runs_before, "the body of a skipped task ran"


def check_fail(c: Ctx, rid: str) -> None:
    resource = f"res:{rid}"
    runs_before = c.ledger.runs()
    with c.test_leases.hold(resource, ttl=LONG_HOLD_TTL):
        result = c.send(c.worker_app.busy_fail, rid, 0.0)
        result.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    assert c.ledger.runs() == runs_before, "the body of a task that found its lease busy ran"
    exc = result.result
    assert isinstance(exc, LeaseBusy), repr(exc)
    assert exc.resource == resource, (
        f"LeaseBusy.resource did not survive the result backend: {exc.resource!r}"
    )


def check_wait(c: Ctx, rid: str) -> None:
    resource = f"res:{rid}"
    with c.test_leases.hold(resource, ttl=LONG_HOLD_TTL):
        result = c.send(c.worker_app.wait_stamped, rid)
        # the task is blocked in its slot, subscribed to the release channel
        wait_until(lambda: c.waiters(resource) > 0, RESULT_TIMEOUT, f"a waiter on {resource}")
        assert not result.ready()
        released_at = time.time()
    out = result.get(timeout=RESULT_TIMEOUT)
    woke_after = out["started"] - released_at
    assert woke_after >= 0, "the waiting task ran before the test released the resource"
    # woken by the release (pub/sub): without it the waiter would sleep about as long as the
    # test's hold had left to live, LONG_HOLD_TTL
    assert woke_after < LONG_HOLD_TTL / 4, f"woke {woke_after:.2f}s after the release"
    assert [r for r, _ in out["leases"]] == [resource]
    # the UNSUBSCRIBE is the returner thread's (a greenlet under gevent and eventlet), sent
    # once the waiter has its grant
    wait_until(lambda: c.waiters(resource) == 0, RESULT_TIMEOUT, f"no waiter on {resource}")
    assert c.test_leases.store.holders(resource) == []


def check_retry(c: Ctx, rid: str, min_busy_retries: int = 3) -> None:
    resource = f"res:{rid}"
    with c.test_leases.hold(resource, ttl=LONG_HOLD_TTL):
        result = c.send(c.worker_app.retry_no_budget, rid)
        wait_until(lambda: result.state == "RETRY", RESULT_TIMEOUT, "state RETRY")
        wait_until(
            lambda: c.busy_retries(result.id) >= min_busy_retries,
            RESULT_TIMEOUT,
            f"{min_busy_retries} busy retries of {result.id}",
        )
        assert not result.ready()
        released_at = time.time()
    out = result.get(timeout=RESULT_TIMEOUT)
    assert result.state == "SUCCESS"
    assert out["started"] >= released_at
    # max_retries=0: a single self.retry() would have failed the task; and the busy retries
    # did not count against the task's own retries
    assert out["retries"] == 0
    assert [r for r, _ in out["leases"]] == [resource]
    assert c.test_leases.store.holders(resource) == []


# --- prefork: one policy per test ---------------------------------------------------------------
def test_skip_returns_none_without_running_the_body(start_worker, ctx):
    check_skip(ctx(start_worker("prefork", 2)), "skip")


def test_fail_raises_lease_busy_naming_the_resource(start_worker, ctx):
    check_fail(ctx(start_worker("prefork", 2)), "fail")


def test_wait_blocks_and_is_woken_by_the_release(start_worker, ctx):
    check_wait(ctx(start_worker("prefork", 2)), "wait")


def test_retry_does_not_use_the_tasks_own_retries(start_worker, ctx):
    check_retry(ctx(start_worker("prefork", 2)), "retry")


def test_retry_gives_up_after_busy_timeout(start_worker, worker_app, send, test_leases, ledger):
    start_worker("prefork", 2)
    busy_timeout = worker_app.busy_retry_short.busy_timeout
    with test_leases.hold("res:a"):
        sent = time.monotonic()
        result = send(worker_app.busy_retry_short, "a", 0.0)
        wait_until(lambda: result.state == "RETRY", RESULT_TIMEOUT, "state RETRY")
        result.get(timeout=busy_timeout * 10, propagate=False)
        elapsed = time.monotonic() - sent
    assert result.state == "FAILURE"
    assert ledger.runs() == 0
    assert isinstance(result.result, LeaseBusy), repr(result.result)
    assert busy_timeout <= elapsed < 2 * busy_timeout, f"gave up after {elapsed:.2f}s"
    assert result.result.resource == "res:a", (
        f"LeaseBusy.resource did not survive the result backend: {result.result.resource!r}"
    )


def test_busy_timeout_is_counted_on_the_redis_clock(start_worker, worker_app, send, test_leases):
    """A worker whose wall clock is an hour ahead keeps retrying a task another worker found
    busy a moment ago (regression: it compared the header's time, stamped on one machine's
    wall clock, with its own, and gave up at once)."""
    worker = start_worker("solo", 1, env={"LEASES_TEST_CLOCK_OFFSET": "3600"})
    headers = {BUSY_SINCE_HEADER: test_leases.store.redis_time(), BUSY_ATTEMPT_HEADER: 0}
    with test_leases.hold("res:skew"):
        result = send(worker_app.busy_retry_short, "skew", 0.0, _options={"headers": headers})
        wait_until(
            lambda: result.ready() or worker.log().count(f"[{result.id}] retry: retrying in") >= 2,
            RESULT_TIMEOUT,
            "two busy retries",
        )
        assert not result.ready(), f"gave up while busy: {result.result!r}"
    out = result.get(timeout=RESULT_TIMEOUT)
    assert out["leases"][0][0] == "res:skew"


# --- threads and solo: every policy in one worker -----------------------------------------------
@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 2), ("solo", 1)])
def test_policies_on_other_pools(start_worker, ctx, pool, concurrency):
    c = ctx(start_worker(pool, concurrency))
    check_skip(c, "skip")
    check_wait(c, "wait")
    check_retry(c, "retry", min_busy_retries=2)
    check_fail(c, "fail")


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_waiting_task_under_the_green_pools(start_worker, ctx, pool):
    check_wait(ctx(start_worker(pool, 2)), "wait")
