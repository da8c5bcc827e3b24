"""Unique tasks sent by a real ``celery beat``: a due run whose key is held is not sent.

Beat sends ``unique_app.gated(key)`` every second. While the first run waits in the queue, and then
while it runs, every later due run is refused (beat logs it and sends nothing); once the run
ended, the next due run is sent. A beat that does not know the task (it sends by name, with
no claim) is covered by the worker side: a copy that finds the key held does not run.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_leases import Leases
from tests.integration.beat.conftest import BeatProc
from tests.support.workers import WorkerProc

from .conftest import APP, RESULT_TIMEOUT, Ledger, wait_until

pytestmark = pytest.mark.worker

REFUSED_RE = re.compile(
    r"leases: beat: unique_app\.gated not sent: unique key 'job:(?P<key>[^']*)' is held by "
    r"(?P<state>queued|running) task (?P<task>\S+)$",
    re.M,
)
SENDING = "Scheduler: Sending due task unique-every-second"


@pytest.fixture
def start_beat(
    request: pytest.FixtureRequest, worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., BeatProc]]:
    """Factory: ``start_beat(key, **env)`` -> ``celery beat`` of ``unique_app`` sending ``key``."""
    made: list[BeatProc] = []

    def start(key: str, **env: str) -> BeatProc:
        argv = [
            sys.executable, "-m", "celery", "-A", APP, "beat",
            "-S", "celery.beat:Scheduler", "--pidfile", "", "--max-interval", "1", "-l", "info",
        ]  # fmt: skip
        beat = BeatProc(
            f"beat{len(made)}",
            argv,
            {**worker_env, "UAPP_BEAT_KEY": key, **env},
            tmp_path / f"beat-{len(made)}.log",
        )
        made.append(beat)
        beat.start()
        beat.wait_for_log("beat: Starting...", 30)
        return beat

    yield start
    for beat in made:
        beat.stop()
    failed = any(
        getattr(request.node, f"rep_{when}", None) is not None
        and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        for beat in made:
            sys.stderr.write(f"\n===== log of {beat.label} =====\n{beat.log()[-15000:]}")


def refusals(beat: BeatProc) -> list[tuple[str, str]]:
    """``(state, task id)`` of each due run beat did not send."""
    return [(m["state"], m["task"]) for m in REFUSED_RE.finditer(beat.log())]


def queued_ids(client: redis.Redis, queue: str) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange(queue, 0, -1))]


def test_beat_sent_duplicates_are_refused_while_queued_and_running(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    leases_redis: redis.Redis,
    queue: str,
    start_beat: Callable[..., BeatProc],
    start_worker: Callable[..., WorkerProc],
):
    beat = start_beat("b")
    wait_until(lambda: len(refusals(beat)) >= 3, RESULT_TIMEOUT, "beat to refuse 3 due runs")
    (first,) = queued_ids(leases_redis, queue)  # one message, however many runs came due
    assert set(refusals(beat)) == {("queued", first)}
    assert beat.log().count(SENDING) >= 4

    start_worker()
    assert ledger.wait_started("b") == [first]
    wait_until(
        lambda: ("running", first) in refusals(beat), RESULT_TIMEOUT, "a refusal while running"
    )
    assert queued_ids(leases_redis, queue) == []
    assert set(refusals(beat)) == {("queued", first), ("running", first)}

    ledger.open_gate("b")
    # the next due run after the end is sent, and runs
    started = ledger.wait_started("b", count=3)
    assert len(set(started)) == len(started)
    assert started[0] == first
    assert ledger.events("finished:b")[:2] == started[:2]


def test_a_beat_that_does_not_know_the_task_is_guarded_by_the_worker(
    producer: Celery,
    ledger: Ledger,
    start_beat: Callable[..., BeatProc],
    start_worker: Callable[..., WorkerProc],
):
    # this beat has no tasks registered: it sends by name, without a claim
    beat = start_beat("n", UAPP_NO_TASKS="1")
    worker = start_worker()
    (first,) = ledger.wait_started("n")
    dropped = f"not run: unique key 'job:n' is held by running task {first}"
    # every copy sent while the first runs finds the key held when it starts: none runs
    wait_until(
        lambda: worker.log().count(dropped) >= 3, RESULT_TIMEOUT, "the worker to drop 3 copies"
    )
    assert refusals(beat) == []  # beat itself sent every due run
    assert ledger.started("n") == [first]
    ledger.open_gate("n")
    later = ledger.wait_started("n", count=2)
    assert later[0] == first
    assert len(set(later)) == len(later)


#: due runs a mode test lets beat send (one a second): without a mode, each would run
DUE = 12
MODE_ENTRIES = {
    # throttle: one accepted send per 3.5 s window
    "throttle": (
        {"task": "unique_app.quick", "options": {"unique_mode": "throttle", "unique_window": 3.5}},
        2,
        5,
    ),
    # debounce: a due run every second never leaves 2 s quiet: a run every max_wait (4 s)
    "debounce": (
        {
            "task": "unique_app.quick",
            "options": {"unique_mode": "debounce", "unique_window": 2, "unique_max_wait": 4},
        },
        1,
        4,
    ),
    # keep_last: runs of 2.5 s, back to back, each with one follow-up
    "keep_last": ({"task": "unique_app.kept", "args": ["m", "beat", 2.5]}, 2, 6),
}


@pytest.mark.parametrize("mode", sorted(MODE_ENTRIES))
def test_beat_entry_options_give_the_mode(
    mode: str,
    ledger: Ledger,
    start_beat: Callable[..., BeatProc],
    start_worker: Callable[..., WorkerProc],
):
    entry, low, high = MODE_ENTRIES[mode]
    start_worker(concurrency=2)
    beat = start_beat("m", UAPP_BEAT_ENTRY=json.dumps(entry))
    wait_until(lambda: beat.log().count(SENDING) >= DUE, DUE * 5, f"beat to send {DUE} due runs")
    beat.stop()
    time.sleep(2 if mode != "debounce" else 6)  # what beat sent last may still run
    started = ledger.started("m")
    print(f"beat, {mode}: {len(started)} run(s) of {beat.log().count(SENDING)} due")
    assert low <= len(started) <= high, started
    assert len(set(started)) == len(started)
    if mode == "keep_last":  # one at a time: each run ended before the next started
        finished = [e.split()[0] for e in ledger.events("finished:m")]
        assert finished == started[: len(finished)]
        assert len(finished) >= len(started) - 1


def test_bad_mode_options_of_a_beat_entry_are_reported_at_start_and_refused(
    ledger: Ledger,
    start_beat: Callable[..., BeatProc],
    start_worker: Callable[..., WorkerProc],
):
    entry = {"task": "unique_app.quick", "options": {"unique_mode": "throttle"}}
    beat = start_beat("z", UAPP_BEAT_ENTRY=json.dumps(entry))
    at_start = (
        "leases: beat entry 'unique-every-second' is refused at each send: task "
        "'unique_app.quick': unique_mode='throttle' needs unique_window= (seconds)"
    )
    wait_until(lambda: at_start in beat.log(), RESULT_TIMEOUT, "beat to report the entry")
    wait_until(
        lambda: beat.log().count("needs unique_window=") >= 3, RESULT_TIMEOUT, "3 refused sends"
    )
    start_worker()
    time.sleep(2)
    assert ledger.started("z") == []  # nothing was sent
