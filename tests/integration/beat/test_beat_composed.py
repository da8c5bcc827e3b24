"""The mixin on redbeat's and django-celery-beat's schedulers, composed as docs/beat.md shows.

Two clusters of three real ``celery beat`` replicas run side by side over one window:

- ``redbeat``: ``LeasedSchedulerMixin`` + ``redbeat.RedBeatScheduler`` (its entries in the test
  Redis, under the cluster's prefix; ``redbeat_lock_key = None``, as the docs say);
- ``django``: ``LeasedSchedulerMixin`` + ``django_celery_beat.schedulers.DatabaseScheduler`` on
  one sqlite file shared by the three replicas.

Each has an entry every second and a ``crontab()`` entry; the window holds a minute boundary
(the replicas start about 20 s before it, so the default suite does not wait 80 s per
scheduler), and in each cluster the replica that sent the latest run is killed with SIGKILL
6 s before the boundary. Runs are counted as messages in the cluster's queue (no worker).
"""

from __future__ import annotations

import math
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import beat_app
from .conftest import (
    REPO,
    BeatCluster,
    Sent,
    close_cluster,
    gaps_ms,
    open_cluster,
    time_passes_until,
    wait_until,
)

pytestmark = pytest.mark.worker

REDBEAT = "tests.integration.beat.sched_redbeat:Scheduler"
DJANGO = "tests.integration.beat.sched_django:Scheduler"
DJANGO_SETTINGS = "tests.integration.beat.djsettings"
INTERVAL_MS = round(beat_app.INTERVAL * 1000)
#: longest gap allowed between consecutive interval sends: one interval, plus as much again
#: for a takeover (the survivors are aligned on the same Redis buckets)
MAX_GAP_MS = 2 * INTERVAL_MS
#: the replicas are started this long before the minute boundary of the window: six beat
#: processes (django and redbeat) need most of it to start on a busy 2-core machine
LEAD_MS = 34_000
#: the victim is killed this long before the boundary; the window ends this long after it
KILL_BEFORE_MS = 6_000
TAIL_MS = 10_000


@dataclass
class Run:
    cluster: BeatCluster
    t0_ms: int  # all replicas started (Redis clock)
    slot_ms: int  # the minute boundary in the window
    end_ms: int
    victim: str
    killed_ms: int
    db: Path | None = None


@dataclass
class Runs:
    redbeat: Run
    django: Run


def migrate(db: Path) -> None:
    """Create django-celery-beat's tables in ``db`` once, before any replica starts."""
    env = {"DJANGO_SETTINGS_MODULE": DJANGO_SETTINGS, "LEASES_BEAT_DJANGO_DB": str(db)}
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env={**_base_env(), **env},
        check=True,
        timeout=120,
    )
    with sqlite3.connect(db) as conn:  # WAL: readers do not wait for the writer
        conn.execute("PRAGMA journal_mode=WAL")


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "LEASES_"))}


def run_counts(db: Path) -> dict[str, int]:
    """``total_run_count`` of every periodic task in the database."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT name, total_run_count FROM django_celery_beat_periodictask")
        return {str(name): int(count) for name, count in rows}


def _kill_latest_sender(cluster: BeatCluster) -> tuple[str, int]:
    seen = len(cluster.sent(beat_app.EVERY_TASK))
    latest: Sent = wait_until(
        lambda: (s := cluster.sent(beat_app.EVERY_TASK)) and len(s) > seen and s[-1],
        10 * beat_app.INTERVAL,
        f"a new run in the queue of {cluster.queue}",
    )
    victim = cluster.replicas[latest.replica]
    return victim.label, victim.kill9(cluster.redis_ms)


@pytest.fixture(scope="module")
def runs(
    leases_redis_url: str, leases_run_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runs]:
    workdir: Path = tmp_path_factory.mktemp("beat-composed")
    db = workdir / "beat.sqlite3"
    migrate(db)
    rb_prefix = f"{leases_run_prefix}-brb"
    rb = open_cluster(
        leases_redis_url,
        rb_prefix,
        workdir / "redbeat",
        LEASES_BEAT_REDBEAT_PREFIX=f"{{{rb_prefix}:redbeat}}:",
    )
    dj = open_cluster(
        leases_redis_url,
        f"{leases_run_prefix}-bdj",
        workdir / "django",
        DJANGO_SETTINGS_MODULE=DJANGO_SETTINGS,
        LEASES_BEAT_DJANGO_DB=str(db),
    )
    ready = False
    try:
        # start about LEAD_MS before a minute boundary (the slot of the window)
        now = rb.redis_ms()
        slot = math.ceil((now + LEAD_MS) / 60_000) * 60_000
        time_passes_until(rb, slot - LEAD_MS, "the start of the window")
        for label in ("A", "B", "C"):
            rb.start(label, scheduler=REDBEAT)
            dj.start(label, scheduler=DJANGO)
        rb.wait_started()
        dj.wait_started()
        t0 = rb.redis_ms()
        assert t0 < slot - KILL_BEFORE_MS - 4 * INTERVAL_MS, "the replicas took too long to start"
        time_passes_until(rb, slot - KILL_BEFORE_MS, "the kill")
        rb_victim, rb_killed = _kill_latest_sender(rb)
        dj_victim, dj_killed = _kill_latest_sender(dj)
        end = slot + TAIL_MS
        time_passes_until(rb, end, "the end of the window")
        rb.stop()
        dj.stop()
        ready = True
        yield Runs(
            Run(rb, t0, slot, end, rb_victim, rb_killed),
            Run(dj, t0, slot, end, dj_victim, dj_killed, db),
        )
    finally:
        if not ready:
            sys.stderr.write(rb.logs() + dj.logs())
        close_cluster(rb)
        close_cluster(dj)


def _duplicates(counter: Counter[int | None]) -> dict[int | None, int]:
    return {run: n for run, n in counter.items() if n > 1}


def check_interval(run: Run, *, shared_store: bool) -> list[Sent]:
    """Each Redis-time bucket sent once, by the replica that claimed it; sends go on after
    the kill. ``shared_store``: as for :func:`check_cron`."""
    sends = run.cluster.sent(beat_app.EVERY_TASK)
    assert sends, "no interval run was sent"
    for s in sends:
        assert s.claim is not None, f"{s} was sent without a claim"
        assert s.claimed_by_pid == s.pid, f"{s} was sent by a replica that did not claim it"
    sent_runs = Counter(s.claimed_run for s in sends)
    assert not _duplicates(sent_runs), f"runs sent more than once: {_duplicates(sent_runs)}"
    # independent of the claims: once every replica has aligned, one send per Redis bucket
    aligned = run.t0_ms + 3 * INTERVAL_MS
    steady = Counter(s.sent_ms // INTERVAL_MS for s in sends if s.sent_ms >= aligned)
    assert not _duplicates(steady), f"Redis-time buckets with two sends: {_duplicates(steady)}"
    # no bucket skipped while a replica lives, the kill included
    late = [s for s in sends if s.sent_ms >= aligned]
    long_gaps = [(g, a, b) for g, a, b in gaps_ms(late) if g > MAX_GAP_MS]
    assert not long_gaps, f"gaps longer than {MAX_GAP_MS} ms between sends: {long_gaps}"
    after = [s for s in sends if s.sent_ms > run.killed_ms]
    assert after, "nothing was sent after the kill"
    assert run.victim not in {s.replica for s in after}
    assert after[-1].sent_ms >= run.end_ms - MAX_GAP_MS
    # the replicas raced: each (with a shared store, more than one) decided runs, and claims
    # were lost
    deciders = {
        label
        for label, beat in run.cluster.replicas.items()
        if beat.claims(beat_app.EVERY_ENTRY) + beat.skips(beat_app.EVERY_ENTRY)
    }
    if shared_store:
        assert len(deciders) >= 2, f"only {deciders} decided interval runs"
    else:
        assert deciders == set(run.cluster.replicas), f"only {deciders} decided interval runs"
    assert run.cluster.skips(beat_app.EVERY_ENTRY), "no replica ever lost a claim"
    return sends


def check_cron(run: Run, *, shared_store: bool) -> Sent:
    """The crontab run of the window sent once, by a survivor; each replica decided it once;
    every skip names the replica that sent it.

    ``shared_store``: the replicas read one copy of the entry (redbeat's, in Redis), so a
    replica that reads it after the winner advanced it never finds that run due, and neither
    claims nor skips it. Otherwise (each replica holds its entries in memory) every survivor
    decides the run.
    """
    cron = run.cluster.sent(beat_app.CRON_TASK)
    for s in cron:
        assert s.claimed_by_pid == s.pid, f"{s} was sent by a replica that did not claim it"
    runs = Counter(s.claimed_run for s in cron)
    assert not _duplicates(runs), f"crontab runs sent more than once: {cron}"
    assert run.slot_ms in runs, f"the crontab run at the boundary was not sent: {cron}"
    (sent,) = [s for s in cron if s.claimed_run == run.slot_ms]
    assert sent.replica != run.victim
    for label, beat in run.cluster.replicas.items():
        decided = Counter(
            d.run for d in beat.claims(beat_app.CRON_ENTRY) + beat.skips(beat_app.CRON_ENTRY)
        )
        assert not _duplicates(decided), f"replica {label} claimed a run again: {decided}"
    skips = [d for d in run.cluster.skips(beat_app.CRON_ENTRY) if d.run == run.slot_ms]
    survivors = set(run.cluster.replicas) - {run.victim}
    skipped_by = {d.replica for d in skips}
    if shared_store:
        assert skipped_by <= survivors - {sent.replica}
    else:
        assert skipped_by == survivors - {sent.replica}
    for d in skips:
        assert d.winner.endswith(f"/{sent.pid}"), f"{d} names another winner than {sent}"
    return sent


def test_redbeat_interval_runs_once_across_a_kill(runs: Runs) -> None:
    check_interval(runs.redbeat, shared_store=True)


def test_redbeat_crontab_run_once_across_a_kill(runs: Runs) -> None:
    check_cron(runs.redbeat, shared_store=True)


def test_django_interval_runs_once_across_a_kill(runs: Runs) -> None:
    check_interval(runs.django, shared_store=False)


def test_django_crontab_run_once_across_a_kill(runs: Runs) -> None:
    check_cron(runs.django, shared_store=False)


def test_django_run_counts_are_the_runs_sent(runs: Runs) -> None:
    """total_run_count in the database counts each run once (the survivors wrote it back)."""
    run = runs.django
    assert run.db is not None
    counts = run_counts(run.db)
    cron = run.cluster.sent(beat_app.CRON_TASK)
    assert counts[beat_app.CRON_ENTRY] == len(cron), (counts, cron)
    every = run.cluster.sent(beat_app.EVERY_TASK)
    assert len(every) - 3 <= counts[beat_app.EVERY_ENTRY] <= len(every) + 1, (counts, len(every))
