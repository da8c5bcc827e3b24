"""``on_duplicate="cancel"`` (issue 31) with real ``celery worker`` processes, and the
``unique_confirm`` opt-in (one script call per published send).

The cancellable tasks record when they start and end on the Redis clock (``TIME``, the one
clock every process shares) and write a report fenced with their claim.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_leases import FencedRedis, LeaseConfigError, Leases, LeaseSettings
from celery_leases._parking import list_parked
from celery_leases._scripts import SHA
from celery_leases.config import renewal_interval
from tests.support.acl import CommandLog
from tests.support.workers import WorkerProc

from .conftest import (
    QUEUE_TTL,
    REPO,
    RESULT_TIMEOUT,
    WORKER_TTL,
    Ledger,
    kill_whole_worker,
    wait_until,
)

pytestmark = pytest.mark.worker

#: sends with on_duplicate="cancel" while the first copy runs
SENDS = 10


def redis_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def spans(ledger: Ledger, key: str) -> dict[str, tuple[int, int | None]]:
    """task id -> (start, end) on the Redis clock (us); end None while it runs."""
    out: dict[str, tuple[int, int | None]] = {}
    for event in ledger.events(f"times:{key}"):
        what, us, *rest = event.split()
        if what == "start":
            out[rest[0]] = (int(us), None)
        elif what == "end":
            out[rest[0]] = (out[rest[0]][0], int(us))
    return out


def runs(ledger: Ledger, key: str) -> list[tuple[str, str]]:
    return [(e.split()[0], e.split()[2]) for e in ledger.events(f"started:{key}")]


def interval() -> float:
    """Seconds between two renewals of a worker's lease (WORKER_TTL, the default margin)."""
    settings = LeaseSettings(ttl=WORKER_TTL)
    return renewal_interval(WORKER_TTL * (1 - settings.lost_margin))


def test_cancel_stops_a_running_copy_and_one_follow_up_runs_with_the_last_arguments(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    task = producer.tasks["unique_app.cancellable"]  # unique_cancel_deadline=20
    start_worker(concurrency=2)  # room for a second copy, were one let through
    first = task.delay("c", "first", 30.0)
    ledger.wait_started("c")
    sent_us = redis_us(ledger.client)
    sent = [task.apply_async(("c", f"n{i}", 0.5), on_duplicate="cancel") for i in range(SENDS)]
    follow_up = sent[0].id
    assert follow_up != first.id
    assert {r.id for r in sent} == {follow_up}  # every send: the one follow-up's result
    assert sent[-1].get(timeout=RESULT_TIMEOUT) == f"n{SENDS - 1}"
    first.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert first.state == "FAILURE"
    assert type(first.result).__name__ == "LeaseRevoked", first.result
    time.sleep(2)  # a second follow-up, if one were sent, would have started by now
    assert runs(ledger, "c") == [(first.id, "first"), (follow_up, f"n{SENDS - 1}")]
    times = spans(ledger, "c")
    (a_start, a_end), (b_start, b_end) = times[first.id], times[follow_up]
    assert a_end is not None
    assert b_end is not None
    assert a_start < a_end <= b_start < b_end  # never two copies at once
    latency = (a_end - sent_us) / 1e6
    print(
        f"cancel: the running copy ended {latency * 1000:.0f} ms after the first cancel send "
        f"(renewal interval {interval() * 1000:.0f} ms); the follow-up started "
        f"{(b_start - a_end) / 1000:.0f} ms after it ended"
    )
    assert latency < interval() + 8.0  # generous: the deadline (20 s) would be far later
    wait_until(lambda: leases_of.store.unique_holder("can:c") is None, 30, "a free key")


def test_cancel_follow_up_runs_once_when_the_cancelled_copys_worker_is_killed(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    task = producer.tasks["unique_app.cancellable"]
    doomed = start_worker(concurrency=1)
    first = task.delay("k", "first", 60.0)
    ledger.wait_started("k")
    start_worker(concurrency=1)  # its pump hands the follow-up on once the claim is gone
    sent = [task.apply_async(("k", f"n{i}"), on_duplicate="cancel") for i in range(SENDS)]
    follow_up = sent[0].id
    assert {r.id for r in sent} == {follow_up}
    kill_whole_worker(doomed)
    assert sent[-1].get(timeout=90) == f"n{SENDS - 1}"
    time.sleep(3)  # a second copy of the follow-up, if one were sent, would have started
    assert runs(ledger, "k") == [(first.id, "first"), (follow_up, f"n{SENDS - 1}")]
    assert [e.split()[0] for e in ledger.events("finished:k")] == [follow_up]
    wait_until(lambda: leases_of.store.unique_holder("can:k") is None, 30, "a free key")


def test_a_copy_that_ignores_the_cancel_is_force_released_at_the_deadline_and_fenced_off(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    start_worker: Callable[..., WorkerProc],
):
    task = producer.tasks["unique_app.stubborn"]  # on_lost="log", unique_cancel_deadline=4
    deadline = 4.0
    start_worker(concurrency=2)
    first = task.delay("s", "first", 12.0)
    ledger.wait_started("s")
    sent_us = redis_us(ledger.client)
    sent = [task.apply_async(("s", f"n{i}", 0.2), on_duplicate="cancel") for i in range(3)]
    follow_up = sent[0].id
    assert {r.id for r in sent} == {follow_up}
    assert sent[-1].get(timeout=RESULT_TIMEOUT) == "n2"
    assert first.get(timeout=RESULT_TIMEOUT) == "first"  # it worked on, as on_lost="log" says
    times = spans(ledger, "s")
    learnt = [e.split() for e in ledger.events("times:s") if e.startswith("learnt")]
    assert learnt
    assert learnt[0][2] == "LeaseRevoked", learnt
    b_start = times[follow_up][0]
    a_end = times[first.id][1]
    assert a_end is not None
    print(
        f"cancel ignored: learnt after {(int(learnt[0][1]) - sent_us) / 1000:.0f} ms; the "
        f"follow-up started {(b_start - sent_us) / 1e6:.2f}s after the cancel (deadline "
        f"{deadline}s), the ignoring copy ended {(a_end - sent_us) / 1e6:.2f}s after it"
    )
    assert int(learnt[0][1]) < sent_us + deadline * 1_000_000
    # the follow-up got the claim at the deadline, not before (the copy still held it)
    assert b_start >= sent_us + deadline * 1_000_000
    # the ignoring copy's late fenced write is refused; the follow-up's stands
    wrote = dict(e.split() for e in ledger.events("wrote:s"))
    assert wrote == {follow_up: "True", first.id: "False"}
    report = FencedRedis(ledger.client, prefix=f"{ledger.prefix}:fenced").key("report:s")
    assert ledger.client.get(report) == "n2"
    wait_until(lambda: leases_of.store.unique_holder("stub:s") is None, 30, "a free key")


def test_cancel_while_a_copy_is_queued_refuse_answers_existing_replace_replaces(
    producer: Celery, leases_of: Leases
):
    quick = producer.tasks["unique_app.quick"]  # refuse; no worker runs
    queued = quick.delay("q")
    again = quick.apply_async(("q",), on_duplicate="cancel")
    assert again.id == queued.id
    replaced = producer.tasks["unique_app.replaced"]
    old = replaced.delay("q", "old")
    new = replaced.apply_async(("q", "new"), on_duplicate="cancel")
    assert new.id != old.id
    holder = leases_of.store.unique_holder("rep:q")
    assert holder is not None
    assert (holder.state, holder.task_id) == ("queued", new.id)
    assert list_parked(leases_of) == []  # a queued copy is never cancelled


def test_cancel_is_refused_where_it_means_nothing(producer: Celery, leases_of: Leases):
    throttled = producer.tasks["unique_app.throttled"]
    with pytest.raises(LeaseConfigError, match="on_duplicate='cancel' is for unique_mode"):
        throttled.apply_async(("t",), on_duplicate="cancel")
    kept = producer.tasks["unique_app.kept"]
    with pytest.raises(LeaseConfigError, match="on_duplicate='cancel' is for unique_mode"):
        kept.apply_async(("t",), on_duplicate="cancel")
    quick = producer.tasks["unique_app.quick"]
    with pytest.raises(LeaseConfigError, match="on_duplicate='cancel' is for unique_mode"):
        quick.apply_async(("t",), on_duplicate="cancel", unique_mode="throttle", unique_window=5)
    assert leases_of.store.unique_holder("thr:t") is None


# --- unique_confirm=False: one script call per published send ------------------------------
#: (task, per-call options, one key for every send) of each mode
MODES = {
    "refuse": ("unique_app.quick", {}, False),
    "throttle": ("unique_app.quick", {"unique_mode": "throttle", "unique_window": 60}, False),
    "replace": ("unique_app.quick", {"unique_mode": "replace"}, False),
    "replace, key taken": ("unique_app.quick", {"unique_mode": "replace"}, True),
    "keep_last": ("unique_app.quick", {"unique_mode": "keep_last"}, False),
    "debounce": ("unique_app.quick", {"unique_mode": "debounce", "unique_window": 60}, False),
    "cancel": ("unique_app.quick", {"on_duplicate": "cancel"}, False),
}
PER_MODE = 20


@pytest.mark.parametrize("confirm", [False, True], ids=["unique_confirm-off", "default"])
def test_script_calls_per_published_send(
    make_producer: Callable[..., Celery], leases_redis_url: str, leases_prefix: str, confirm: bool
):
    producer = make_producer(unique_confirm=confirm)
    shas = set(SHA.values())
    counts = {}
    for n, (mode, (name, options, one_key)) in enumerate(MODES.items()):
        task = producer.tasks[name]
        task.delay(f"warm{n}", **{})  # the scripts are loaded, the broker connected
        with CommandLog(leases_redis_url) as log:
            for i in range(PER_MODE):
                task.apply_async((f"m{n}" if one_key else f"m{n}-{i}",), **options)
        calls = [
            line
            for line in log.lines
            if line.upper().startswith("EVALSHA ")
            and leases_prefix in line
            and line.split()[1] in shas
        ]
        counts[mode] = len(calls) / PER_MODE
    print(f"unique_confirm={confirm}: script calls per send {counts}")
    expected = 1.0 if not confirm else 2.0
    for mode, per_send in counts.items():
        assert per_send == (1.0 if mode == "debounce" else expected), counts


_DIES = """
import os, signal, sys
from tests.integration.unique import unique_app
url, prefix, queue, confirm = sys.argv[1:5]
app = unique_app.make_app(
    broker=url, queue=queue, backend=url, redis_url=url, key_prefix=prefix,
    unique_confirm=confirm == "1", unique_confirm_window=2.0, unique_ttl=120.0,
)
# killed between its claim and its publish
app.amqp.send_task_message = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
app.tasks["unique_app.quick"].delay("dies")
"""


@pytest.mark.parametrize("confirm", [True, False], ids=["default", "unique_confirm-off"])
def test_a_producer_killed_before_its_publish_blocks_the_key_for_window_or_queue_ttl(
    leases_of: Leases, leases_redis_url: str, leases_prefix: str, queue: str, confirm: bool
):
    argv = [sys.executable, "-c", _DIES, leases_redis_url, leases_prefix, queue]
    done = subprocess.run([*argv, "1" if confirm else "0"], cwd=REPO, timeout=120, check=False)
    assert done.returncode == -9
    holder = leases_of.store.unique_holder("job:dies")
    assert holder is not None
    assert holder.state == "queued"
    assert holder.expires_in is not None
    if confirm:
        assert holder.expires_in <= 2.0  # pending: unique_confirm_window
        wait_until(lambda: leases_of.store.unique_holder("job:dies") is None, 30, "a free key")
    else:
        assert holder.expires_in > QUEUE_TTL / 2  # the queue TTL from the claim on
        time.sleep(3)  # past the window: still held
        assert leases_of.store.unique_holder("job:dies") is not None
