"""Beat entries' overlap policy and catch-up window, with real ``celery beat`` replicas.

The overlap tests run a real worker on the replicas' queue: each run of ``beat_app.slow``
records its start and end on the Redis clock. The catch-up tests stop every replica for an
outage and start them again on the same schedule files.

The issue asks for a 90 s outage. Nothing in the code makes 90 s special: an outage is a
bucket of the entry's interval that no replica claimed, on the Redis clock, and the catch-up
window is compared with the age of the latest missed due time. So the outage is scaled with
the interval: a 5 s interval and a 20 s outage (three whole buckets missed, or more), which
keeps the file well under two minutes.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_leases._beat_claims import BeatClaim
from celery_leases._beat_runs import run_key
from celery_leases._sync.driver import LeaseStore
from tests.support.workers import WorkerProc, kill_whole_worker, worker_factory

from .conftest import BeatCluster, time_passes_until, wait_until

pytestmark = pytest.mark.integration

APP = "tests.integration.beat.beat_app"
#: the entry of the overlap tests (see beat_app)
OVERLAP_ENTRY = "overlap"
#: the interval of the catch-up entry and the outage of every replica, in seconds
EVERY = 5.0
OUTAGE = 20.0
CATCHES_UP_RE = re.compile(r"leases: beat catches up catchup \(bucket (\d+)\)")
NO_CATCH_UP_RE = re.compile(
    r"leases: beat skips catchup \(bucket (\d+)\): missed while no replica ran, no catch-up"
)


@dataclass(frozen=True)
class Run:
    """One run of ``beat_app.slow``, as the task recorded it (Redis clock, ms)."""

    start: int
    end: int
    task_id: str


def runs_of(cluster: BeatCluster) -> list[Run]:
    out = []
    for line in cluster.client.lrange(f"{cluster.queue}:runs", 0, -1):
        start, end, task_id = line.split()
        out.append(Run(int(start), int(end), task_id))
    return sorted(out, key=lambda r: r.start)


def worker_env(cluster: BeatCluster) -> dict[str, str]:
    """The environment of a worker of ``beat_app`` on the cluster's queue and key prefix."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "LEASES_"))}
    return {
        **base,
        "LEASES_BEAT_BROKER": cluster.redis_url,
        "LEASES_BEAT_QUEUE": cluster.queue,
        "CELERY_LEASES_REDIS_URL": cluster.redis_url,
        "CELERY_LEASES_KEY_PREFIX": cluster.prefix,
        "CELERY_LEASES_TTL": "3",
        "PYTHONUNBUFFERED": "1",
        **cluster.env,
    }


@contextmanager
def workers(
    request: pytest.FixtureRequest, cluster: BeatCluster, logs: Path
) -> Iterator[Callable[..., WorkerProc]]:
    logs.mkdir(parents=True, exist_ok=True)
    with worker_factory(request.node, APP, worker_env(cluster), logs, "w") as start:
        yield start
    cluster.client.delete(f"{cluster.queue}:runs")


def overlaps(runs: list[Run]) -> list[tuple[Run, Run]]:
    return [(a, b) for a, b in itertools.pairwise(runs) if b.start < a.end]


def logs_of(cluster: BeatCluster) -> str:
    return "".join(beat.log() for beat in cluster.replicas.values())


# --- the claim script after an outage -------------------------------------------------------
def _redis_ms(store: LeaseStore) -> int:
    seconds, micros = store.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_an_interval_outage_skips_the_missed_run_or_catches_up_once(leases_store: LeaseStore):
    """beat_claim.lua on a real Redis: after buckets nobody claimed, no window records the
    latest missed run as skipped and holds the next run until its due time (the middle of
    its bucket); a window that covers the latest missed due time claims one catch-up run."""
    every, store = 2.0, leases_store

    def claim(entry: str, window: float | None) -> BeatClaim:
        return store.claim_beat_run(
            entry, due_ms=None, bucket=every, replica="a", keep=60, catch_up=window
        )

    firsts = {entry: claim(entry, window) for entry, window in (("none", None), ("w", 60.0))}
    assert all(c.won and not c.catch_up for c in firsts.values())
    last = max(c.run for c in firsts.values())
    wait_until(lambda: _redis_ms(store) >= (last + 3) * every * 1000, 30, "two missed buckets")

    skipped = claim("none", None)
    assert (skipped.won, skipped.refused) == (False, "skipped")
    assert skipped.run >= firsts["none"].run + 2
    assert skipped.retry_ms == round((skipped.run + 1.5) * every * 1000)
    again = claim("none", None)  # before the next due time: not sent, not skipped again
    assert not again.won
    assert again.refused in ("", "early")
    wait_until(lambda: _redis_ms(store) >= (skipped.retry_ms or 0), 30, "the next due time")
    due = claim("none", None)
    assert (due.won, due.catch_up, due.run) == (True, False, skipped.run + 1)

    caught = claim("w", 60.0)
    assert (caught.won, caught.catch_up) == (True, True)
    assert not claim("w", 60.0).won  # one catch-up run


def test_a_crontab_outage_presents_its_latest_run_then_skips_or_catches_up(
    leases_store: LeaseStore,
):
    """A crontab run whose next run is due too is "missed": the latest due run is presented
    instead, and caught up only when it is within the window."""
    store, minute = leases_store, 60_000
    now = _redis_ms(leases_store)
    old = now - 5 * minute  # the last run claimed before the outage
    latest = now - minute // 2  # the latest run due (30 s ago)

    def claim(entry: str, due: int, window: float | None, **kw: Any) -> BeatClaim:
        return store.claim_beat_run(
            entry, due_ms=due, bucket=None, replica="a", keep=600, catch_up=window, **kw
        )

    for entry, window in (("none", None), ("w60", 60.0), ("w10", 10.0)):
        assert claim(entry, old, window, next_due_ms=old + minute).won
        missed = claim(entry, old + minute, window, next_due_ms=old + 2 * minute)
        assert (missed.won, missed.refused) == (False, "missed")
        final = claim(entry, latest, window, latest=True)
        if entry == "w60":
            assert (final.won, final.catch_up) == (True, True)
        else:  # no window, or a window shorter than the 30 s since the latest due time
            assert (final.won, final.refused) == (False, "skipped")
            value = str(store.client.get(store.keys.beat_claim(entry, "cron")))
            assert value.startswith(f"{latest} ")
            assert value.endswith(" skipped:a")
        assert not claim(entry, latest, window, latest=True).won  # decided once


# --- overlap ------------------------------------------------------------------------------
def test_skip_sends_no_run_while_the_previous_one_runs(
    make_beat_cluster: Callable[..., BeatCluster],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A 3 s task every 1 s with ``leases_overlap="skip"``, two replicas, a worker with two
    slots: no two runs overlap, and the entry still runs again and again."""
    cluster = make_beat_cluster(LEASES_BEAT_ENTRIES="overlap", LEASES_BEAT_OVERLAP="skip")
    with workers(request, cluster, tmp_path / "w") as start:
        worker = start(concurrency=2)
        cluster.start("a")
        cluster.start("b")
        cluster.wait_started()
        wait_until(lambda: len(runs_of(cluster)) >= 4, 90, "four runs of the overlap entry")
        cluster.stop()
        runs = runs_of(cluster)
        log = worker.log()
    assert overlaps(runs) == [], f"runs overlapped: {runs}\n{log[-5000:]}"
    # the replicas held runs back (a 1 s entry, 3 s runs): the skips are what kept them apart
    skips = logs_of(cluster).count(f"leases: beat skips {OVERLAP_ENTRY}: its previous run")
    assert skips >= 3, f"only {skips} runs held back"
    gaps = [(b.start - a.end) / 1000 for a, b in itertools.pairwise(runs)]
    print(f"skip: {len(runs)} runs, gaps between a run's end and the next start: {gaps}")


def test_buffer_one_sends_the_held_back_run_when_the_previous_one_ends(
    make_beat_cluster: Callable[..., BeatCluster],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A 7 s task every 6 s with ``leases_overlap="buffer_one"``: no two runs overlap, and the
    run held back starts soon after the previous one ends, not at the next due time (with
    skip, the next due time is 5 s after each end; the poll is 1 s)."""
    cluster = make_beat_cluster(
        LEASES_BEAT_ENTRIES="overlap",
        LEASES_BEAT_OVERLAP="buffer_one",
        LEASES_BEAT_OVERLAP_EVERY="6",
        LEASES_BEAT_RUN_FOR="7",
    )
    with workers(request, cluster, tmp_path / "w") as start:
        start(concurrency=2)
        cluster.start("a")
        cluster.start("b")
        cluster.wait_started()
        wait_until(lambda: len(runs_of(cluster)) >= 2, 90, "two runs of the overlap entry")
        cluster.stop()
        runs = runs_of(cluster)
    assert overlaps(runs) == [], f"runs overlapped: {runs}"
    gaps = [(b.start - a.end) / 1000 for a, b in itertools.pairwise(runs)]
    print(f"buffer_one: {len(runs)} runs, gaps between a run's end and the next start: {gaps}")
    # each run after the first was buffered (due while the previous ran): it started within
    # the 1 s poll of the previous end, plus a generous margin for a loaded machine
    assert max(gaps) < 3.0, f"a buffered run waited for its next due time: {gaps}"
    assert f"leases: beat buffers {OVERLAP_ENTRY}" in logs_of(cluster)


def test_a_killed_worker_frees_the_run_marker_within_the_lease_ttl(
    make_beat_cluster: Callable[..., BeatCluster],
    leases_store: LeaseStore,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """kill -9 of the worker mid-run: the run marker is a lease of the process that ran the
    run, so it runs out within the lease TTL (3 s here) and the entry runs again on another
    worker; it never stays stuck."""
    cluster = make_beat_cluster(
        LEASES_BEAT_ENTRIES="overlap", LEASES_BEAT_OVERLAP="skip", LEASES_BEAT_RUN_FOR="8"
    )
    assert cluster.prefix == leases_store.settings.key_prefix

    def running() -> str | None:
        holder = leases_store.unique_holder(run_key(OVERLAP_ENTRY))
        return holder.task_id if holder is not None and holder.state == "running" else None

    with workers(request, cluster, tmp_path / "w") as start:
        first = start(concurrency=1)
        cluster.start("a")
        cluster.start("b")
        cluster.wait_started()
        killed_task = wait_until(running, 60, "a run of the overlap entry to start")
        kill_whole_worker(first)
        killed_ms = cluster.redis_ms()
        start(concurrency=1)  # another node: only the lease TTL frees the marker
        again = wait_until(
            lambda: (task := running()) != killed_task and task,
            60,
            "another run to start after the kill",
        )
        freed_after = (cluster.redis_ms() - killed_ms) / 1000
        cluster.stop()
    print(f"a run started again {freed_after:.1f}s after the worker's kill -9")
    assert again != killed_task
    # the lease TTL (3 s), the new worker's start and the entry's next look: generous
    assert freed_after < 30, "the run marker outlived its lease TTL by far"


# --- catch-up -----------------------------------------------------------------------------
def test_one_catch_up_run_with_the_window_none_without(
    make_beat_cluster: Callable[..., BeatCluster],
) -> None:
    """Every replica stops for an outage of several intervals, then starts again: with
    ``leases_catchup_window`` (60 s) exactly one catch-up run is sent at start-up; without
    it none, and the entry waits for its next due time (the middle of a bucket of the Redis
    clock). The two clusters run side by side, on their own prefixes and queues."""
    env = {"LEASES_BEAT_ENTRIES": "catchup", "LEASES_BEAT_CATCHUP_EVERY": str(EVERY)}
    window = make_beat_cluster(**env, LEASES_BEAT_WINDOW="60")
    none = make_beat_cluster(**env)
    clusters = (window, none)
    for cluster in clusters:
        cluster.start("a")
        cluster.start("b")
    for cluster in clusters:
        cluster.wait_started()
    for cluster in clusters:
        wait_until(lambda c=cluster: c.messages(), 60, "a run before the outage")
    for cluster in clusters:
        cluster.stop()
    before = {id(c): len(c.messages()) for c in clusters}
    down_ms = window.redis_ms()
    time_passes_until(window, down_ms + round(OUTAGE * 1000), "the outage")
    restart_ms = window.redis_ms()
    for cluster in clusters:
        cluster.start("a")
        cluster.start("b")
    for cluster in clusters:
        cluster.wait_started()
    # two due times after the start-up, for the runs that follow it
    time_passes_until(window, window.redis_ms() + round(2.5 * EVERY * 1000), "runs after it")
    for cluster in clusters:
        cluster.stop()

    # with the window: one catch-up run, then the entry's due runs, each bucket once
    log = logs_of(window)
    caught = [int(b) for b in CATCHES_UP_RE.findall(log)]
    assert len(caught) == 1, f"catch-up runs: {caught}"
    assert NO_CATCH_UP_RE.findall(log) == []
    after = [s for s in window.messages() if s.sent_ms >= restart_ms]
    assert len(window.messages()) - before[id(window)] == len(after)
    buckets = [s.claimed_run for s in after]
    assert buckets[0] == caught[0], f"the first run after the outage is not the catch-up: {after}"
    assert buckets == sorted(set(buckets)), f"a bucket sent twice: {buckets}"
    assert len(after) >= 2, "no due run after the catch-up run"

    # without: the missed run is skipped once, and every run sent after it is a due run
    log = logs_of(none)
    assert CATCHES_UP_RE.findall(log) == []
    skipped = [int(b) for b in NO_CATCH_UP_RE.findall(log)]
    assert len(skipped) == 1, f"outage skips: {skipped}"
    after = [s for s in none.messages() if s.sent_ms >= restart_ms]
    assert after, "the entry did not run again after the outage"
    every_ms = EVERY * 1000
    for sent in after:
        assert sent.claimed_run is not None
        assert sent.claimed_run > skipped[0]
        due_ms = (sent.claimed_run + 0.5) * every_ms
        # sent at its due time, not at start-up (1 s of slack for the replicas' clocks)
        assert sent.sent_ms >= due_ms - 1000, f"a run sent before it was due: {sent}"
    first = (after[0].sent_ms - restart_ms) / 1000
    print(f"without a window, the first run came {first:.1f}s after the restart")


def test_an_unknown_policy_stops_beat_at_start_up(
    make_beat_cluster: Callable[..., BeatCluster],
) -> None:
    """An invalid entry option is an error when beat loads the schedule, naming the entry."""
    cluster = make_beat_cluster(LEASES_BEAT_ENTRIES="overlap", LEASES_BEAT_OVERLAP="sometimes")
    beat = cluster.start("a")
    assert beat.proc is not None
    beat.proc.wait(60)
    assert beat.proc.returncode != 0
    assert "beat entry 'overlap': leases_overlap='sometimes' is not one of" in beat.log()
