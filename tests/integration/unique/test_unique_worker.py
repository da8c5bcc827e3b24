"""Unique tasks with real ``celery worker`` processes: refused while queued or running, free
again however the task ends, a retry keeps its own claim, and the handover is checked.

The producer is this test process (a copy of ``unique_app`` on the workers' queue and key prefix).
Running claims are leases with the workers' TTL (3 s unless a test sets another).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from celery_leases import DuplicateTask, Leases
from celery_leases._claims import ClaimHolder
from tests.support.workers import WorkerProc

from .conftest import RESULT_TIMEOUT, Ledger, kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

LONG_TTL = 60.0


def holder(leases: Leases, key: str) -> ClaimHolder | None:
    return leases.store.unique_holder(f"job:{key}")


def wait_free(leases: Leases, key: str, timeout: float, what: str) -> None:
    wait_until(lambda: holder(leases, key) is None, timeout, what)


def wait_state(leases: Leases, key: str, state: str, task_id: str) -> ClaimHolder:
    def seen() -> ClaimHolder | None:
        h = holder(leases, key)
        return h if h is not None and (h.state, h.task_id) == (state, task_id) else None

    found: ClaimHolder = wait_until(seen, RESULT_TIMEOUT, f"claim of {key} {state} by {task_id}")
    return found


def test_refused_while_queued_and_while_running_accepted_after_success(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    gated = producer.tasks["unique_app.gated"]
    first = gated.delay("k")
    queued = gated.delay("k")  # no worker yet: it waits in the queue
    assert queued.id == first.id
    with pytest.raises(DuplicateTask) as info:
        gated.apply_async(("k",), on_duplicate="raise")
    assert (info.value.task_id, info.value.state) == (first.id, "queued")

    worker = start_worker()
    assert ledger.wait_started("k") == [first.id]
    running = wait_state(leases_of, "k", "running", first.id)
    assert running.owner is not None
    assert worker.hostname in running.owner
    assert gated.delay("k").id == first.id
    with pytest.raises(DuplicateTask) as info:
        gated.apply_async(("k",), on_duplicate="raise")
    assert (info.value.task_id, info.value.state) == (first.id, "running")

    ledger.open_gate("k")
    assert first.get(timeout=RESULT_TIMEOUT) == first.id
    # released in the task's own finalizer, before its result was stored
    assert holder(leases_of, "k") is None
    second = gated.delay("k")
    assert second.id != first.id
    assert second.get(timeout=RESULT_TIMEOUT) == second.id
    assert ledger.started("k") == [first.id, second.id]


def test_accepted_again_after_a_failure(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker()
    failed = producer.tasks["unique_app.failing"].delay("k")
    with pytest.raises(ValueError, match="on purpose"):
        failed.get(timeout=RESULT_TIMEOUT)
    assert holder(leases_of, "k") is None
    after = producer.tasks["unique_app.quick"].delay("k")
    assert after.id != failed.id
    assert after.get(timeout=RESULT_TIMEOUT) == after.id


def test_accepted_again_after_revoke_before_it_ran(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker()
    # a countdown keeps it waiting in the worker, not started, while it is revoked
    waiting = producer.tasks["unique_app.quick"].apply_async(("k",), countdown=3)
    wait_state(leases_of, "k", "queued", waiting.id)
    waiting.revoke()
    # the worker discards it when it comes due; the claim goes with it, not at the queue TTL
    wait_free(leases_of, "k", RESULT_TIMEOUT, "the revoked task's claim to be given back")
    assert ledger.started("k") == []
    again = producer.tasks["unique_app.quick"].delay("k")
    assert again.id != waiting.id
    assert again.get(timeout=RESULT_TIMEOUT) == again.id


def test_accepted_again_after_revoke_terminate(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker(env={"CELERY_LEASES_TTL": str(LONG_TTL)})
    running = producer.tasks["unique_app.sleeper"].delay("k")
    ledger.wait_started("k")
    wait_state(leases_of, "k", "running", running.id)
    assert producer.tasks["unique_app.sleeper"].delay("k").id == running.id

    running.revoke(terminate=True)

    # the child's finalizer runs on SIGTERM: free long before the 60 s lease could run out
    wait_free(leases_of, "k", LONG_TTL / 3, "the terminated task's claim to be released")
    again = producer.tasks["unique_app.quick"].delay("k")
    assert again.id != running.id
    assert again.get(timeout=RESULT_TIMEOUT) == again.id


def test_accepted_again_after_the_pool_child_is_killed(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    worker = start_worker(env={"CELERY_LEASES_TTL": str(LONG_TTL)})
    running = producer.tasks["unique_app.sleeper"].delay("k")
    (entry,) = wait_until(lambda: ledger.events("started:k"), RESULT_TIMEOUT, "the task to start")
    pid = int(entry.split()[1])
    assert pid in worker.children()

    os.kill(pid, signal.SIGKILL)

    # the worker's main process frees a dead child's leases (the claim is one) at once
    wait_free(leases_of, "k", LONG_TTL / 3, "the killed child's claim to be released")
    again = producer.tasks["unique_app.quick"].delay("k")
    assert again.id != running.id
    assert again.get(timeout=RESULT_TIMEOUT) == again.id


def test_a_task_replaced_by_a_task_of_the_same_key_keeps_the_claim_for_it(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker()
    replacing = producer.tasks["unique_app.replacing"].delay("k")
    ledger.wait_started("k")
    wait_state(leases_of, "k", "running", replacing.id)
    assert producer.tasks["unique_app.quick"].delay("k").id == replacing.id  # a duplicate
    ledger.open_gate("k")

    # Task.replace sends the replacement under the same task id: its own claim lets it run
    assert replacing.get(timeout=RESULT_TIMEOUT) == replacing.id
    assert ledger.started("k") == [replacing.id, replacing.id]
    assert ledger.events("started:k")[1].endswith(" replacement")
    wait_free(leases_of, "k", RESULT_TIMEOUT, "the replacement's claim to be released")


def test_an_acks_late_task_redelivered_after_its_child_was_killed_runs_again(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # acks_late + reject_on_worker_lost: the message of the killed run comes back; its claim
    # (running, under the dead child) must not make the redelivered copy a duplicate
    worker = start_worker(env={"CELERY_LEASES_TTL": str(LONG_TTL)})
    late = producer.tasks["unique_app.late"].delay("k")
    (entry,) = wait_until(lambda: ledger.events("started:k"), RESULT_TIMEOUT, "the task to start")
    pid = int(entry.split()[1])
    assert pid in worker.children()
    wait_state(leases_of, "k", "running", late.id)

    os.kill(pid, signal.SIGKILL)

    assert late.get(timeout=RESULT_TIMEOUT) == late.id
    assert ledger.started("k") == [late.id, late.id]
    wait_free(leases_of, "k", LONG_TTL / 3, "the redelivered run's claim to be released")


def test_accepted_again_after_the_whole_worker_is_killed_once_the_ttl_ran_out(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    ttl = 10.0
    worker = start_worker(env={"CELERY_LEASES_TTL": str(ttl)})
    running = producer.tasks["unique_app.sleeper"].delay("k")
    ledger.wait_started("k")
    wait_state(leases_of, "k", "running", running.id)

    kill_whole_worker(worker)

    # nobody is left to release it: the claim is refused on until its lease runs out
    refused = holder(leases_of, "k")
    assert refused is not None
    assert (refused.state, refused.task_id) == ("running", running.id)
    assert producer.tasks["unique_app.sleeper"].delay("k").id == running.id
    wait_free(leases_of, "k", 3 * ttl, "the dead worker's claim to run out")
    start_worker()
    again = producer.tasks["unique_app.quick"].delay("k")
    assert again.id != running.id
    assert again.get(timeout=RESULT_TIMEOUT) == again.id


def test_accepted_again_after_a_hard_time_limit(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker(env={"CELERY_LEASES_TTL": str(LONG_TTL)})
    limited = producer.tasks["unique_app.hard_limited"].delay("k")
    with pytest.raises(TimeLimitExceeded):
        limited.get(timeout=RESULT_TIMEOUT)
    wait_free(leases_of, "k", LONG_TTL / 3, "the time-limited task's claim to be released")
    assert producer.tasks["unique_app.quick"].delay("k").get(timeout=RESULT_TIMEOUT)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_retry_keeps_its_own_claim(
    pool: str,
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    start_worker(pool=pool)
    retrying = producer.tasks["unique_app.retrying"].apply_async(("k",), kwargs={"countdown": 2})

    # the first run retried itself: the retry waits, holding the claim, queued again
    wait_until(lambda: ledger.events("started:k"), RESULT_TIMEOUT, "the first run")
    wait_state(leases_of, "k", "queued", retrying.id)
    duplicate = producer.tasks["unique_app.gated"].delay("k")
    assert duplicate.id == retrying.id
    # the retry (same task id) is not refused by its own claim: it runs
    wait_until(lambda: len(ledger.events("started:k")) >= 2, RESULT_TIMEOUT, "the retried run")
    wait_state(leases_of, "k", "running", retrying.id)
    assert producer.tasks["unique_app.gated"].delay("k").id == retrying.id

    ledger.open_gate("k")
    assert retrying.get(timeout=RESULT_TIMEOUT) == "done after 1 retry"
    assert ledger.events("started:k") == [f"{retrying.id} 0", f"{retrying.id} 1"]
    assert holder(leases_of, "k") is None


def test_busy_retries_keep_the_claim(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    start_worker()
    with leases_of.hold("res:k", ttl=30):
        leased = producer.tasks["unique_app.leased"].delay("k")
        # it finds res:k busy and retries (on_busy="retry"), again and again; meanwhile no
        # duplicate gets in
        wait_until(
            lambda: (
                (h := holder(leases_of, "k")) is not None
                and h.task_id == leased.id
                and h.state == "queued"
                and ledger.events("started:k") == []
            ),
            RESULT_TIMEOUT,
            "the busy task to wait for its retry",
        )
        assert producer.tasks["unique_app.leased"].delay("k").id == leased.id
    assert leased.get(timeout=RESULT_TIMEOUT) == leased.id
    assert ledger.started("k") == [leased.id]
    assert holder(leases_of, "k") is None


def test_the_handover_is_checked_against_the_task_id(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    leases_redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerProc],
):
    # a claim queued for a task that is somewhere in the queue (here: nowhere)
    leases_of.store.unique_claim("job:k", "the-queued-one", 120)
    # a copy published around the claim: by a process that does not know the task is unique
    plain = Celery("plain", broker=leases_redis_url, backend=leases_redis_url, set_as_current=False)
    try:
        stranger = plain.send_task("unique_app.quick", ("k",), queue=queue)
        start_worker()
        # the worker does not hand the claim to another task id: that copy does not run
        assert stranger.get(timeout=RESULT_TIMEOUT) is None
        assert ledger.started("k") == []
        still = holder(leases_of, "k")
        assert still is not None
        assert (still.state, still.task_id) == ("queued", "the-queued-one")

        assert leases_of.store.unique_unclaim("job:k", "the-queued-one")
        # without a claim, the worker takes the key itself when the task starts
        unclaimed = plain.send_task("unique_app.gated", ("k",), queue=queue)
        assert ledger.wait_started("k") == [unclaimed.id]
        wait_state(leases_of, "k", "running", unclaimed.id)
        assert producer.tasks["unique_app.quick"].delay("k").id == unclaimed.id
        ledger.open_gate("k")
        assert AsyncResult(unclaimed.id, app=plain).get(timeout=RESULT_TIMEOUT) == unclaimed.id
    finally:
        plain.close()


def test_redis_unreachable_as_the_worker_takes_the_claim_retries_the_task_with_it(
    make_producer: Callable[..., Celery],
    make_redis_server: Callable[..., Any],
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    # the claims live on a private server that is frozen between the publish and the start;
    # broker and ledger stay on the test Redis
    server = make_redis_server()
    producer = make_producer(redis_url=server.url)
    leases_of: Leases = producer.leases  # type: ignore[attr-defined]
    worker = start_worker(
        env={"CELERY_LEASES_REDIS_URL": server.url, "CELERY_LEASES_SOCKET_TIMEOUT": "0.5"}
    )
    quick = producer.tasks["unique_app.quick"].apply_async(("k",), countdown=3)
    server.pause()
    try:
        # the worker cannot take the claim over, retries the task (on_backend_error), and
        # sends that retry although it cannot touch the claim: refusing would lose the task
        wait_until(
            lambda: "sends its retry without renewing its unique claim" in worker.log(),
            RESULT_TIMEOUT,
            "the retry of a task that could not reach Redis",
        )
    finally:
        server.resume()
    assert quick.get(timeout=RESULT_TIMEOUT) == quick.id
    assert ledger.started("k") == [quick.id]
    assert holder(leases_of, "k") is None
