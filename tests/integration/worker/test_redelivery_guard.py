"""The redelivery guard with real workers and the real Redis broker (and RabbitMQ).

The Redis transport is set to restore an unacknowledged delivery after 3 s
(``visibility_timeout=3``), and its restore sweep runs every second. Each test has its own
queue, kombu key prefix (``global_keyprefix``) and leases prefix. The tasks are plain
``@app.task(acks_late=True)`` tasks of tests/integration/worker/guard_app.py, which count each
start and end in a ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.support.polling import wait_until
from tests.support.workers import (
    REPO,
    WorkerProc,
    amqp_url_or_skip,
    kill_whole_worker,
    pytest_runtest_makereport,
    worker_factory,
)

__all__ = ("pytest_runtest_makereport",)

APP = "tests.integration.worker.guard_app"
#: the broker's visibility timeout in these tests (seconds)
VISIBILITY = 3.0
#: the length of the slow task (seconds): more than twice the visibility timeout
TASK_SECONDS = 8.0
#: the first run of a task whose worker is killed once another worker is up: starting that
#: worker took 9 s at load 15, and a run that ended before the kill left nothing to redeliver
KILLED_RUN_SECONDS = 120.0


@pytest.fixture
def guard_env(leases_redis_url: str, leases_prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_LEASES_", "GUARD_"))}
    env.update(
        {
            "GUARD_BROKER": leases_redis_url,
            "GUARD_QUEUE": f"q-{leases_prefix}",
            # under the test's prefix: the session's cleanup deletes these keys
            "GUARD_KEYPREFIX": f"{{{leases_prefix}:kombu}}:",
            "GUARD_VISIBILITY": str(VISIBILITY),
            "GUARD_LEDGER": leases_redis_url,
            "CELERY_LEASES_REDIS_URL": leases_redis_url,
            "CELERY_LEASES_KEY_PREFIX": leases_prefix,
            "CELERY_LEASES_TTL": "3",
            "CELERY_LEASES_REDELIVERY_GUARD": "true",
            "CELERY_LEASES_REDELIVERY_RECHECK": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def start(
    request: pytest.FixtureRequest, guard_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProc]]:
    with worker_factory(request.node, APP, guard_env, tmp_path, "g") as factory:
        yield factory


class Fleet:
    """Sends this test's tasks and reads its ledger."""

    def __init__(self, env: dict[str, str], broker: str) -> None:
        from celery import Celery

        self.queue = env["GUARD_QUEUE"]
        self.prefix = env["CELERY_LEASES_KEY_PREFIX"]
        self.app = Celery("guard_sender", broker=broker)
        options = {"global_keyprefix": env["GUARD_KEYPREFIX"]} if broker.startswith("redis") else {}
        self.app.conf.update(task_default_queue=self.queue, broker_transport_options=options)
        self.ledger = redis.Redis.from_url(env["GUARD_LEDGER"], decode_responses=True)

    def send(self, name: str, *args: object, **options: object) -> str:
        return str(self.app.send_task(f"{APP}.{name}", args, **options).id)

    def count(self, event: str, task_id: str) -> int:
        return int(self.ledger.get(f"{{{self.prefix}:ledger}}:{event}:{task_id}") or 0)

    def close(self) -> None:
        self.app.close()
        self.ledger.close()


@pytest.fixture
def fleet(guard_env: dict[str, str]) -> Iterator[Fleet]:
    f = Fleet(guard_env, guard_env["GUARD_BROKER"])
    yield f
    f.close()


def _received(worker: WorkerProc, task_id: str) -> int:
    return worker.log().count(f"Task {APP}.slow[{task_id}] received")


def _quiet_for(seconds: float, check: Callable[[], None]) -> None:
    """Run ``check`` every 0.2 s for ``seconds`` (a duplicate would show within them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        check()
        time.sleep(0.2)
    check()


def test_without_the_guard_a_long_acks_late_task_runs_twice(
    start: Callable[..., WorkerProc], fleet: Fleet, guard_env: dict[str, str]
) -> None:
    """The control: the scenario the guard is for really makes a duplicate."""
    start(concurrency=2, env={**guard_env, "CELERY_LEASES_REDELIVERY_GUARD": "false"})
    task_id = fleet.send("slow", TASK_SECONDS)
    wait_until(lambda: fleet.count("started", task_id) >= 2, 30, "a second run")
    wait_until(lambda: fleet.count("finished", task_id) >= 2, 30, "both runs to end")


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_with_the_guard_it_runs_once(
    start: Callable[..., WorkerProc], fleet: Fleet, pool: str
) -> None:
    worker = start(pool=pool, concurrency=1 if pool == "solo" else 2)
    task_id = fleet.send("slow", TASK_SECONDS)
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 30, "the task to end")

    def once() -> None:
        assert fleet.count("started", task_id) == 1

    _quiet_for(2 * VISIBILITY, once)
    # the heartbeat kept the delivery fresh: the broker never restored it
    assert _received(worker, task_id) == 1
    assert "the redelivery guard is on" in worker.log()


def test_a_copy_delivered_while_the_first_runs_waits_and_is_dropped(
    start: Callable[..., WorkerProc], fleet: Fleet, guard_env: dict[str, str]
) -> None:
    """Without the keep-alive the broker restores the running task's message: the copies meet
    the guard lease, wait for the outcome and are dropped when the first copy finishes."""
    worker = start(concurrency=2, env={**guard_env, "GUARD_NO_KEEPALIVE": "1"})
    task_id = fleet.send("slow", TASK_SECONDS)
    wait_until(lambda: "waiting for that copy's outcome" in worker.log(), 30, "a waiting copy")
    other = fleet.send("slow", 0.1)  # the waiting copy does not keep it from running
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 30, "the first copy to end")
    wait_until(lambda: "already ended (SUCCESS)" in worker.log(), 30, "the copy to be dropped")
    wait_until(lambda: fleet.count("finished", other) >= 1, 30, "the other task")

    def once() -> None:
        assert fleet.count("started", task_id) == 1

    _quiet_for(2 * VISIBILITY, once)


def test_two_tasks_on_two_workers_run_once_each(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    workers = [start(concurrency=2), start(concurrency=2)]
    ids = [fleet.send("slow", TASK_SECONDS) for _ in range(2)]
    for task_id in ids:
        wait_until(lambda t=task_id: fleet.count("finished", t) >= 1, 40, "both to end")

    def once() -> None:
        for task_id in ids:
            assert fleet.count("started", task_id) == 1

    _quiet_for(2 * VISIBILITY, once)
    for task_id in ids:
        assert sum(_received(w, task_id) for w in workers) == 1


def test_a_killed_workers_task_completes_elsewhere(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    victim = start(concurrency=1)
    task_id = fleet.send("slow", TASK_SECONDS, KILLED_RUN_SECONDS)
    wait_until(lambda: fleet.count("started", task_id) >= 1, 30, "the first run")
    rescuer = start(concurrency=1)
    kill_whole_worker(victim)
    killed = time.monotonic()
    wait_until(lambda: fleet.count("started", task_id) >= 2, 60, "a run elsewhere")
    restarted = time.monotonic() - killed
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 60, "its end elsewhere")
    completed = time.monotonic() - killed
    print(
        f"\nredis broker, kill -9: the task ran again after {restarted:.1f}s and completed "
        f"{completed:.1f}s after the kill (visibility_timeout {VISIBILITY:.0f}s, ttl 3s)"
    )

    def once_more() -> None:
        assert fleet.count("started", task_id) == 2
        assert fleet.count("finished", task_id) == 1

    _quiet_for(2 * VISIBILITY, once_more)
    assert _received(rescuer, task_id) == 1


def test_an_eta_task_past_the_visibility_timeout_runs_once(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    worker = start(concurrency=2)
    task_id = fleet.send("slow", 0.5, countdown=2 * VISIBILITY)
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 40, "the task to end")

    def once() -> None:
        assert fleet.count("started", task_id) == 1

    _quiet_for(2 * VISIBILITY, once)
    assert _received(worker, task_id) == 1


def test_a_completed_task_whose_ack_was_lost_does_not_run_again(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    victim = start(concurrency=1)
    task_id = fleet.send("lose_ack")
    wait_until(lambda: fleet.count("killing", task_id) >= 1, 30, "the kill")
    wait_until(lambda: not victim.alive(), 10, "the victim to die")
    rescuer = start(concurrency=1)  # its restore sweep gives the unacked message back
    wait_until(lambda: "already ended (SUCCESS)" in rescuer.log(), 60, "the copy to be dropped")

    def once() -> None:
        assert fleet.count("started", task_id) == 1

    _quiet_for(2 * VISIBILITY, once)


def test_a_task_id_published_again_after_its_end_does_not_run_again(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    """A second message of a finished task id that the broker does not flag (kombu's publish
    retry after a lost confirm sends one) is a copy too: the completion record drops it."""
    worker = start(pool="solo", concurrency=1)
    task_id = fleet.send("slow", 0.1)
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 30, "the task to end")
    fleet.send("slow", 0.1, task_id=task_id)  # the same task id, not flagged redelivered
    wait_until(
        lambda: "already ended (SUCCESS)" in worker.log() or fleet.count("started", task_id) >= 2,
        30,
        "the second message to be handled",
    )

    def once() -> None:
        n = fleet.count("started", task_id)
        assert n == 1, f"n={n}"

    _quiet_for(2, once)
    assert "dropped a copy" in worker.log()


def test_a_retry_with_the_same_task_id_is_not_taken_for_a_copy(
    start: Callable[..., WorkerProc], fleet: Fleet
) -> None:
    worker = start(concurrency=1)
    task_id = fleet.send("retry_once")
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 30, "the retry to end")
    assert fleet.count("started", task_id) == 2
    assert "dropped a copy" not in worker.log()


def test_a_guard_lease_shows_in_leases_ls_with_its_task_id(
    start: Callable[..., WorkerProc], fleet: Fleet, guard_env: dict[str, str]
) -> None:
    worker = start(concurrency=1)
    # long enough for a ``celery leases ls`` on a busy machine (a few seconds); killed below
    task_id = fleet.send("slow", 60.0)
    wait_until(lambda: fleet.count("started", task_id) >= 1, 30, "the task to start")
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "leases", "ls", "--json"],
        cwd=REPO,
        env=guard_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (row,) = [r for r in json.loads(out) if r["resource"].startswith("celery_leases:redelivery:")]
    assert row["resource"] == f"celery_leases:redelivery:{task_id}"
    assert row["task_id"] == task_id
    assert worker.hostname in row["owner"]
    kill_whole_worker(worker)  # not a minute's warm shutdown


def test_a_restarted_worker_frees_its_dead_predecessors_guards_at_once(
    start: Callable[..., WorkerProc], fleet: Fleet, guard_env: dict[str, str]
) -> None:
    """With a ttl of 30 s, the copy runs long before the dead guard lease would run out."""
    worker = start(concurrency=1, env={**guard_env, "CELERY_LEASES_TTL": "30"})
    task_id = fleet.send("slow", TASK_SECONDS)
    wait_until(lambda: fleet.count("started", task_id) >= 1, 30, "the first run")
    kill_whole_worker(worker)
    worker.start()
    assert f"celery_leases:redelivery:{task_id}" in worker.current_log().split(" ready.")[0]
    wait_until(lambda: fleet.count("finished", task_id) >= 1, 25, "the copy to run to its end")
    assert fleet.count("started", task_id) == 2


def test_rabbitmq_a_killed_workers_task_completes_elsewhere(
    start: Callable[..., WorkerProc], guard_env: dict[str, str]
) -> None:
    amqp = amqp_url_or_skip()
    env = {**guard_env, "GUARD_BROKER": amqp}
    victim = start(concurrency=1, env=env)
    fleet = Fleet(env, amqp)
    try:
        task_id = fleet.send("slow", TASK_SECONDS, KILLED_RUN_SECONDS)
        wait_until(lambda: fleet.count("started", task_id) >= 1, 30, "the first run")
        start(concurrency=1, env=env)
        kill_whole_worker(victim)
        killed = time.monotonic()
        wait_until(lambda: fleet.count("started", task_id) >= 2, 60, "a run elsewhere")
        restarted = time.monotonic() - killed
        wait_until(lambda: fleet.count("finished", task_id) >= 1, 60, "its end elsewhere")
        print(
            f"\nrabbitmq, kill -9: the task ran again after {restarted:.1f}s and completed "
            f"{time.monotonic() - killed:.1f}s after the kill (ttl 3s)"
        )

        def once_more() -> None:
            assert fleet.count("started", task_id) == 2
            assert fleet.count("finished", task_id) == 1

        _quiet_for(3.0, once_more)
    finally:
        with fleet.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(fleet.queue)
        fleet.close()
