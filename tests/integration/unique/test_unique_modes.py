"""``unique_mode`` (issue 31) with real ``celery worker`` processes: throttle and replace.

Many producers race through real processes (``racer.py``) and this test process; the runs are
counted in the ledger the tasks write.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_leases import DuplicateTask, LeaseConfigError, Leases
from tests.support.workers import WorkerProc

from . import racer
from .conftest import RESULT_TIMEOUT, Ledger, kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: 200 producers: 4 processes of 40 threads, and 40 threads of this process
PROCESSES = 4
THREADS = 40
PRODUCERS = PROCESSES * THREADS + THREADS


def race_producers(
    producer: Celery, url: str, prefix: str, queue: str, key: str, task: str
) -> list[str]:
    """Every one of :data:`PRODUCERS` threads sends ``task(key, tag)`` at once; their
    outcomes (see :func:`racer.race_producers`)."""
    return racer.race_producers(
        producer, url, prefix, queue, key,
        processes=PROCESSES, threads=THREADS, local_threads=THREADS, task=task,
    )  # fmt: skip


def runs(ledger: Ledger, key: str) -> list[tuple[str, str]]:
    """``(task id, tag)`` of every body that started for ``key``."""
    out = []
    for event in ledger.events(f"started:{key}"):
        task_id, _pid, tag = [*event.split(" ", 2), ""][:3]
        out.append((task_id, tag))
    return out


# --- throttle ---------------------------------------------------------------------------------
def test_throttle_200_concurrent_producers_give_one_run(
    producer: Celery,
    leases_redis_url: str,
    leases_prefix: str,
    queue: str,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    outcomes = race_producers(
        producer, leases_redis_url, leases_prefix, queue, "t", "unique_app.throttled"
    )
    sent = [o.split()[1:] for o in outcomes if o.startswith("sent")]
    assert len(sent) == 1, sent
    ((winner, tag),) = sent
    assert all(o == f"duplicate {winner}" for o in outcomes if not o.startswith("sent"))

    start_worker()
    assert AsyncResult(winner, app=producer).get(timeout=RESULT_TIMEOUT) == winner
    assert runs(ledger, "t") == [(winner, tag)]
    # the run ended, but its window (30 s from the publish) has not: still refused, and says so
    with pytest.raises(DuplicateTask) as info:
        producer.tasks["unique_app.throttled"].delay("t", "late")
    assert (info.value.task_id, info.value.state) == (winner, "throttled")
    time.sleep(2)  # a refused send that got through anyway would have started by now
    assert runs(ledger, "t") == [(winner, tag)]


def test_throttle_as_send_options_of_a_refuse_task_as_a_beat_entry_gives_them(
    producer: Celery, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # a beat entry's "options" reach apply_async as these keyword arguments
    quick = producer.tasks["unique_app.quick"]  # unique="job:{key}", no mode of its own
    options = {"unique_mode": "throttle", "unique_window": 8, "on_duplicate": "raise"}
    start_worker()
    before = time.monotonic()
    first = quick.apply_async(("w",), **options)
    first.get(timeout=RESULT_TIMEOUT)
    refused_at = time.monotonic()
    with pytest.raises(DuplicateTask) as info:
        quick.apply_async(("w",), **options)
    if refused_at - before < 8:  # on a machine slow enough to take 8 s, nothing to check here
        assert (info.value.task_id, info.value.state) == (first.id, "throttled")
    # without the options the task is a refuse task again: its key is free
    plain = quick.apply_async(("w",), on_duplicate="raise")
    plain.get(timeout=RESULT_TIMEOUT)

    def accepted() -> AsyncResult | None:
        try:
            return quick.apply_async(("w",), **options)
        except DuplicateTask:
            return None

    second = wait_until(accepted, 60, "the throttle window to end", step=0.25)
    assert time.monotonic() - before >= 8  # the window counts from the first publish
    second.get(timeout=RESULT_TIMEOUT)
    assert [r[0] for r in runs(ledger, "w")] == [first.id, plain.id, second.id]


def test_bad_send_options_are_a_config_error_and_send_nothing(
    producer: Celery, leases_of: Leases, leases_redis: redis.Redis, queue: str
):
    quick = producer.tasks["unique_app.quick"]
    with pytest.raises(LeaseConfigError, match="unique_mode='sometimes'"):
        quick.apply_async(("k",), unique_mode="sometimes")
    with pytest.raises(LeaseConfigError, match="needs unique_window="):
        quick.apply_async(("k",), unique_mode="throttle")
    with pytest.raises(LeaseConfigError, match="means nothing with unique_mode='replace'"):
        quick.apply_async(("k",), unique_mode="replace", unique_window=3)
    assert leases_redis.llen(queue) == 0
    assert leases_of.store.unique_holder("job:k") is None


# --- replace ----------------------------------------------------------------------------------
def test_replace_200_concurrent_producers_give_one_run_with_the_last_arguments(
    producer: Celery,
    leases_of: Leases,
    leases_redis_url: str,
    leases_prefix: str,
    queue: str,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    outcomes = race_producers(
        producer, leases_redis_url, leases_prefix, queue, "r", "unique_app.replaced"
    )
    # nothing runs yet: each send takes the place of the one queued before it
    assert all(o.startswith("sent") for o in outcomes), outcomes
    tags = dict(o.split()[1:] for o in outcomes)
    assert len(tags) == PRODUCERS
    last = leases_of.store.unique_holder("rep:r")
    assert last is not None
    assert last.state == "queued"
    assert last.task_id in tags

    ledger.open_gate("r")
    start_worker()
    results = [AsyncResult(task_id, app=producer) for task_id in tags]
    wait_until(
        lambda: all(r.ready() for r in results), 120, "every message to be consumed", step=0.5
    )
    assert runs(ledger, "r") == [(last.task_id, tags[last.task_id])]
    assert AsyncResult(last.task_id, app=producer).get() == tags[last.task_id]
    assert [r.result for r in results if r.id != last.task_id] == [None] * (PRODUCERS - 1)


def test_replace_a_running_copy_is_a_duplicate_and_a_replaced_copy_never_runs(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    replaced = producer.tasks["unique_app.replaced"]
    start_worker()
    running = replaced.delay("g", "a")
    wait_until(lambda: runs(ledger, "g"), RESULT_TIMEOUT, "the first run to start")
    with pytest.raises(DuplicateTask) as info:
        replaced.delay("g", "b")
    assert (info.value.task_id, info.value.state) == (running.id, "running")
    ledger.open_gate("g")
    assert running.get(timeout=RESULT_TIMEOUT) == "a"

    # a copy that waits for its countdown is replaced by one sent after it, which runs first;
    # when the replaced copy's time comes the key is free, and still it does not run
    old = replaced.apply_async(("g", "old"), countdown=4)
    new = replaced.delay("g", "new")
    assert new.get(timeout=RESULT_TIMEOUT) == "new"
    assert old.get(timeout=RESULT_TIMEOUT) is None
    assert [tag for _, tag in runs(ledger, "g")] == ["a", "new"]
    assert leases_of.store.unique_holder("rep:g") is None


# --- keep_last --------------------------------------------------------------------------------
BURST = 50


def test_keep_last_50_sends_during_a_run_give_one_follow_up_with_the_last_arguments(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    kept = producer.tasks["unique_app.kept"]
    start_worker()
    first = kept.delay("k", "first", 3.0)
    wait_until(lambda: runs(ledger, "k"), RESULT_TIMEOUT, "the first run to start")
    sent = [kept.delay("k", f"n{i}") for i in range(BURST)]
    follow_up = sent[0].id
    assert follow_up != first.id
    assert {r.id for r in sent} == {follow_up}  # every send of the burst: the one run's result
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    assert sent[-1].get(timeout=RESULT_TIMEOUT) == f"n{BURST - 1}"
    time.sleep(2)  # a second follow-up, if one were sent, would have started by now
    assert runs(ledger, "k") == [(first.id, "first"), (follow_up, f"n{BURST - 1}")]
    # the follow-up started after the first run ended: one at a time
    assert [e.split()[0] for e in ledger.events("finished:k")] == [first.id, follow_up]
    assert leases_of.store.unique_holder("keep:k") is None


def test_keep_last_sends_while_queued_give_their_arguments_to_the_queued_copy(
    producer: Celery, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    kept = producer.tasks["unique_app.kept"]
    sent = [kept.delay("q", f"q{i}") for i in range(10)]  # no worker yet: one copy queued
    assert {r.id for r in sent} == {sent[0].id}
    start_worker()
    assert sent[0].get(timeout=RESULT_TIMEOUT) == "q9"
    time.sleep(2)
    assert runs(ledger, "q") == [(sent[0].id, "q9")]


def test_keep_last_follow_up_runs_once_when_the_worker_running_the_first_is_killed(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    kept = producer.tasks["unique_app.kept"]
    doomed = start_worker(concurrency=1)
    first = kept.delay("x", "first", 60.0)
    wait_until(lambda: runs(ledger, "x"), RESULT_TIMEOUT, "the first run to start")
    start_worker(concurrency=1)  # its pump hands the follow-up on once the first is gone
    sent = [kept.delay("x", f"n{i}") for i in range(BURST)]
    follow_up = sent[0].id
    assert {r.id for r in sent} == {follow_up}
    kill_whole_worker(doomed)
    assert sent[-1].get(timeout=60) == f"n{BURST - 1}"
    time.sleep(3)  # a second copy of the follow-up, if one were sent, would have started
    assert runs(ledger, "x") == [(first.id, "first"), (follow_up, f"n{BURST - 1}")]
    assert [e.split()[0] for e in ledger.events("finished:x")] == [follow_up]
    wait_until(lambda: leases_of.store.unique_holder("keep:x") is None, 30, "the key to be free")


def test_keep_last_follow_up_redelivered_after_its_child_was_killed_runs_again(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # acks_late + reject_on_worker_lost: the follow-up's message comes back after its pool
    # child was killed mid-run; its hand-on was consumed when it started, and the copy must
    # not be taken for a second copy of a consumed hand-on (it never finished: it runs again)
    kept = producer.tasks["unique_app.kept_late"]
    worker = start_worker(concurrency=1)
    first = kept.delay("d", "first", 2.0)
    wait_until(lambda: runs(ledger, "d"), RESULT_TIMEOUT, "the first run to start")
    sent = [kept.delay("d", f"n{i}", 60.0) for i in range(10)]
    follow_up = sent[0].id
    assert {r.id for r in sent} == {follow_up}
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    started = wait_until(
        lambda: [e for e in ledger.events("started:d") if e.startswith(follow_up)],
        RESULT_TIMEOUT,
        "the follow-up to start",
    )
    pid = int(started[0].split()[1])
    assert pid in worker.children()

    os.kill(pid, signal.SIGKILL)

    assert sent[-1].get(timeout=RESULT_TIMEOUT) == "n9"
    assert [e.split()[0] for e in ledger.events("finished:d")] == [first.id, follow_up]
    assert [t for t, _ in runs(ledger, "d")] == [first.id, follow_up, follow_up]
    wait_until(lambda: leases_of.store.unique_holder("keeplate:d") is None, 60, "a free key")


# --- debounce ---------------------------------------------------------------------------------
def test_debounce_100_sends_in_2_s_give_one_run_with_the_last_arguments(
    producer: Celery, leases_of: Leases, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    debounced = producer.tasks["unique_app.debounced"]  # window 3 s, max wait 30 s
    start_worker()
    sent = []
    for i in range(100):
        sent.append(debounced.delay("b", f"d{i}"))
        time.sleep(0.02)
    assert {r.id for r in sent} == {sent[0].id}  # every send: the one run's result
    assert sent[0].get(timeout=RESULT_TIMEOUT) == "d99"
    time.sleep(2)
    assert runs(ledger, "b") == [(sent[0].id, "d99")]
    wait_until(lambda: leases_of.store.unique_holder("deb:b") is None, 30, "the key to be free")


#: the steady stream: a send every STEP s for STREAM s, with a window it never leaves quiet
STEP, STREAM, QUIET, MAX_WAIT = 0.25, 14.0, 1.0, 4.0
#: what a run may take past max_wait: the pump's interval (1 s) and a loaded machine
MARGIN = 4.0


def test_debounce_steady_stream_runs_at_least_every_max_wait_as_send_options(
    producer: Celery, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # the options a beat entry's "options" give, on a task declared without a mode
    quick = producer.tasks["unique_app.quick"]
    options = {"unique_mode": "debounce", "unique_window": QUIET, "unique_max_wait": MAX_WAIT}
    start_worker()
    started = time.monotonic()
    seen: list[float] = []  # when each run was first seen, from the start of the stream
    last = None
    i = 0
    while time.monotonic() - started < STREAM:
        last = quick.apply_async(("s", f"s{i}"), **options)
        i += 1
        time.sleep(STEP)
        seen += [time.monotonic() - started] * (len(runs(ledger, "s")) - len(seen))
    assert last is not None
    assert last.get(timeout=RESULT_TIMEOUT) == last.id  # quick returns its task id
    seen += [time.monotonic() - started] * (len(runs(ledger, "s")) - len(seen))
    tags = [tag for _, tag in runs(ledger, "s")]
    assert tags[-1] == f"s{i - 1}"  # the burst's end ran with the last send's arguments
    assert len(set(tags)) == len(tags)  # each run is another send's arguments
    during = [t for t in seen if t < STREAM]  # the runs while the stream went on
    ends = [0.0, *during, STREAM]  # no run for longer than max_wait, to the stream's end
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(ends)]
    print(f"debounce steady stream: runs seen at {[round(t, 2) for t in seen]} s, gaps {gaps}")
    assert len(during) >= int(STREAM / (MAX_WAIT + MARGIN)), seen
    assert all(gap <= MAX_WAIT + MARGIN for gap in gaps), gaps


def test_debounce_a_burst_across_a_release_still_waits_for_quiet(
    producer: Celery, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # the release of the running copy finds the follow-up's burst still going: no hand-on
    # until the window is quiet, then one run with the last arguments
    kept = producer.tasks["unique_app.kept"]  # sleeps; sent with debounce options
    options = {"unique_mode": "debounce", "unique_window": 1.0}
    start_worker()
    first = kept.apply_async(("r", "first", 3.0), **options)
    wait_until(lambda: runs(ledger, "r"), RESULT_TIMEOUT, "the first run to start")
    sent = []
    while not ledger.events("finished:r"):  # a send every 0.2 s until the first run ended
        sent.append(kept.apply_async(("r", f"r{len(sent)}"), **options))
        time.sleep(0.2)
    for _ in range(5):  # and a second more
        sent.append(kept.apply_async(("r", f"r{len(sent)}"), **options))
        time.sleep(0.2)
    assert {r.id for r in sent} == {sent[0].id}
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    assert sent[-1].get(timeout=RESULT_TIMEOUT) == f"r{len(sent) - 1}"
    time.sleep(2)
    assert runs(ledger, "r") == [(first.id, "first"), (sent[0].id, f"r{len(sent) - 1}")]


def test_a_worker_without_mode_tasks_publishes_a_per_call_debounced_run(
    producer: Celery, ledger: Ledger, start_worker: Callable[..., WorkerProc]
):
    # the worker's app declares no task with a unique_mode: its pump must still run, for
    # sends that ask for debounce per call (a beat entry's options)
    start_worker(env={"UAPP_NO_MODE_TASKS": "1"})
    quick = producer.tasks["unique_app.quick"]
    options = {"unique_mode": "debounce", "unique_window": 1.0}
    sent = [quick.apply_async(("p", f"p{i}"), **options) for i in range(5)]
    assert {r.id for r in sent} == {sent[0].id}
    assert sent[0].get(timeout=RESULT_TIMEOUT) == sent[0].id
    assert runs(ledger, "p") == [(sent[0].id, "p4")]
