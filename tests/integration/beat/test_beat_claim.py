"""Claim mode with real ``celery beat`` replicas: every due run is sent once.

Two clusters of three replicas run side by side over one window (to share its length, which
must hold a crontab minute slot):

- ``kill``: replicas A, B, C on the real clock; midway, the replica that sent the latest run is
  killed with SIGKILL right after its message reached the queue;
- ``skew``: S0 on the real clock, Sp7 seven seconds ahead, Sm5 five seconds behind (the clock
  that beat reads to decide what is due, see ``beat_app.SkewedScheduler``).

Both have an entry every second (``every-1s``) and a crontab entry every minute. Runs are
counted as messages in the cluster's queue (no worker consumes it); each message carries the
Redis time it was sent at and the claim Redis held for it when it was sent.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import beat_app
from .conftest import (
    BeatCluster,
    Sent,
    close_cluster,
    gaps_ms,
    open_cluster,
    time_passes_until,
    wait_until,
)

pytestmark = pytest.mark.worker

INTERVAL_MS = round(beat_app.INTERVAL * 1000)
#: longest gap allowed between consecutive sends of the interval entry: one interval, plus as
#: much again for a takeover (the survivors are aligned on the same Redis buckets)
MAX_GAP_MS = 2 * INTERVAL_MS
#: the window holds at least this many interval runs
WINDOW_MS = 25_000
#: the crontab slot observed is at least this far after the start (so that the replica whose
#: clock is 7 s ahead started before it saw the slot)
SLOT_LEAD_MS = 10_000
#: the window lasts this long after the slot (so that the replica 5 s behind reaches it)
SLOT_TAIL_MS = 8_000
SKEWS = {"S0": 0.0, "Sp7": 7.0, "Sm5": -5.0}


@dataclass
class ClaimRuns:
    kill: BeatCluster
    skew: BeatCluster
    t0_ms: int  # all replicas started (Redis clock)
    slot_ms: int  # the crontab slot in the window (epoch ms, on a minute boundary)
    end_ms: int
    victim: str
    killed_ms: int


@pytest.fixture(scope="module")
def claim_runs(
    leases_redis_url: str, leases_run_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClaimRuns]:
    workdir: Path = tmp_path_factory.mktemp("beat-claim")
    kill = open_cluster(leases_redis_url, f"{leases_run_prefix}-bkill", workdir / "kill")
    skew = open_cluster(leases_redis_url, f"{leases_run_prefix}-bskew", workdir / "skew")
    ready = False
    try:
        for label in ("A", "B", "C"):
            kill.start(label)
        for label, seconds in SKEWS.items():
            skew.start(label, skew=seconds)
        kill.wait_started()
        skew.wait_started()
        t0 = kill.redis_ms()
        slot = math.ceil((t0 + SLOT_LEAD_MS) / 60_000) * 60_000
        end = max(t0 + WINDOW_MS, slot + SLOT_TAIL_MS)
        kill_at = (t0 + end) // 2
        if abs(kill_at - slot) < 2 * INTERVAL_MS:  # not while the crontab slot is being sent
            kill_at = slot + 2 * INTERVAL_MS
        time_passes_until(kill, kill_at, "the middle of the window")

        # kill the replica that sent the latest run, right after its message is in the queue
        seen = len(kill.sent(beat_app.EVERY_TASK))
        latest: Sent = wait_until(
            lambda: (s := kill.sent(beat_app.EVERY_TASK)) and len(s) > seen and s[-1],
            5 * beat_app.INTERVAL,
            "a new run in the kill cluster's queue",
        )
        victim = kill.replicas[latest.replica]
        killed_ms = victim.kill9(kill.redis_ms)

        time_passes_until(kill, end, "the end of the window")
        kill.stop()
        skew.stop()
        ready = True
        yield ClaimRuns(kill, skew, t0, slot, end, victim.label, killed_ms)
    finally:
        if not ready:  # the set-up failed: show what the replicas said
            sys.stderr.write(kill.logs() + skew.logs())
        close_cluster(kill)
        close_cluster(skew)


def _duplicates(counter: Counter[int]) -> dict[int, int]:
    return {run: n for run, n in counter.items() if n > 1}


def check_interval_runs(cluster: BeatCluster, t0_ms: int, end_ms: int) -> list[Sent]:
    """Each interval bucket of the window sent once, none skipped, no gap; returns the sends.

    The replicas are stopped after ``end_ms`` with SIGTERM, whose handler in celery beat raises
    SystemExit wherever beat is: a run claimed after the window may be cut between its claim
    and its publish (docs/beat.md, at most once). The window's runs are whole.
    """

    # a bucket that starts at end_ms itself is claimed at end_ms or just after: as the stop
    # comes (a replica claimed bucket end_ms, logged "Sending due task", and SIGTERM cut it
    # before its publish: 56 claims against 55 messages), so it is not the window's
    def in_window(run: int | None) -> bool:
        return run is not None and run * INTERVAL_MS < end_ms

    sends = [s for s in cluster.sent(beat_app.EVERY_TASK) if in_window(s.claimed_run)]
    claims = [d for d in cluster.claims(beat_app.EVERY_ENTRY) if in_window(d.run)]
    claimed = Counter(d.run for d in claims)
    assert not _duplicates(claimed), f"buckets claimed more than once: {_duplicates(claimed)}"
    assert len(sends) == len(claims), "messages in the queue != claims in the replicas' logs"

    # every message was sent by the replica that holds the claim of its run, one per run
    for s in sends:
        assert s.claimed_by_pid == s.pid, f"{s} was sent by a replica that did not claim it"
    sent_runs = Counter(s.claimed_run for s in sends)
    assert not _duplicates(sent_runs), f"runs sent more than once: {_duplicates(sent_runs)}"
    assert set(sent_runs) == set(claimed)
    # a run is the bucket of the Redis clock it was claimed in; it is sent at once
    for s in sends:
        run = s.claimed_run
        assert run is not None
        assert 0 <= s.sent_ms - run * INTERVAL_MS < 2 * INTERVAL_MS, f"{s} is not in bucket {run}"
    # no bucket skipped while a replica lives
    runs = sorted(claimed)
    assert runs == list(range(runs[0], runs[-1] + 1)), "buckets skipped"

    # independent of the claims: once every replica has aligned (after its first claim, one
    # interval after it started), one send per bucket of the Redis clock
    aligned = t0_ms + 3 * INTERVAL_MS
    steady = Counter(s.sent_ms // INTERVAL_MS for s in sends if s.sent_ms >= aligned)
    assert not _duplicates(steady), f"Redis-time buckets with two sends: {_duplicates(steady)}"

    long_gaps = [(g, a, b) for g, a, b in gaps_ms(sends) if g > MAX_GAP_MS]
    assert not long_gaps, f"gaps longer than {MAX_GAP_MS} ms between sends: {long_gaps}"
    assert sends[0].sent_ms <= t0_ms + MAX_GAP_MS
    assert sends[-1].sent_ms >= end_ms - MAX_GAP_MS
    assert len(sends) >= (end_ms - t0_ms) // INTERVAL_MS - 2

    # the replicas really raced: each one decided runs, and claims were lost; each sent what
    # it claimed and logged as sent
    for label, beat in cluster.replicas.items():
        decided = beat.claims(beat_app.EVERY_ENTRY) + beat.skips(beat_app.EVERY_ENTRY)
        assert decided, f"replica {label} never decided an interval run"
        mine = [s for s in sends if s.replica == label]
        claimed_here = [d for d in beat.claims(beat_app.EVERY_ENTRY) if in_window(d.run)]
        assert len(mine) == len(claimed_here)
        assert len(beat.sending(beat_app.EVERY_ENTRY)) >= len(mine)
    assert cluster.skips(beat_app.EVERY_ENTRY), "no replica ever lost a claim: nothing was deduped"
    return sends


def check_cron_slot(
    cluster: BeatCluster, slot_ms: int, deciders: set[str], spread_ms: int = 0
) -> Sent:
    """Every crontab slot sent exactly once; every replica in ``deciders`` claimed or skipped
    ``slot_ms``. (A window may hold one more slot than ``slot_ms``, just as the replicas start.)
    ``spread_ms``: how far apart the replicas' clocks are."""
    cron = cluster.sent(beat_app.CRON_TASK)
    for s in cron:
        assert s.claimed_by_pid == s.pid, f"{s} was sent by a replica that did not claim it"
    slots = Counter(s.claimed_run for s in cron)
    assert not _duplicates(slots), f"crontab slots sent more than once: {cron}"
    assert all(run is not None and run % 60_000 == 0 for run in slots), f"not minutes: {cron}"
    claimed = Counter(d.run for d in cluster.claims(beat_app.CRON_ENTRY))
    assert not _duplicates(claimed), f"crontab slots claimed more than once: {claimed}"
    assert set(claimed) == set(slots)
    # independent of the claims: on the Redis clock, sends are a minute apart (give or take
    # how far the replicas' clocks are apart)
    for gap, a, b in gaps_ms(cron):
        assert gap >= 60_000 - spread_ms - MAX_GAP_MS, f"two crontab sends {gap} ms apart: {a} {b}"

    (sent,) = [s for s in cron if s.claimed_run == slot_ms]
    skips = [d for d in cluster.skips(beat_app.CRON_ENTRY) if d.run == slot_ms]
    assert {d.replica for d in skips} == deciders - {sent.replica}
    for d in skips:
        assert d.winner.endswith(f"/{sent.pid}"), f"{d} names another winner than {sent}"
    return sent


def test_interval_runs_once_across_replicas_and_a_kill(claim_runs: ClaimRuns) -> None:
    c = claim_runs
    sends = check_interval_runs(c.kill, c.t0_ms, c.end_ms)
    before = [s for s in sends if s.sent_ms < c.killed_ms]
    after = [s for s in sends if s.sent_ms > c.killed_ms]
    assert before, "nothing was sent before the kill"
    assert before[-1].replica == c.victim
    assert after, "nothing was sent after the kill"
    assert {s.replica for s in after} <= set(c.kill.replicas) - {c.victim}
    assert after[0].sent_ms - before[-1].sent_ms <= MAX_GAP_MS
    assert len({s.replica for s in sends}) >= 2


def test_crontab_slot_once_across_replicas_and_a_kill(claim_runs: ClaimRuns) -> None:
    c = claim_runs
    alive = set(c.kill.replicas)
    if c.killed_ms < c.slot_ms:
        alive.discard(c.victim)
    check_cron_slot(c.kill, c.slot_ms, alive)


def test_skewed_clocks_send_interval_runs_once(claim_runs: ClaimRuns) -> None:
    check_interval_runs(claim_runs.skew, claim_runs.t0_ms, claim_runs.end_ms)


def test_skewed_clocks_send_crontab_slot_once(claim_runs: ClaimRuns) -> None:
    c = claim_runs
    spread = round((max(SKEWS.values()) - min(SKEWS.values())) * 1000)
    sent = check_cron_slot(c.skew, c.slot_ms, set(SKEWS), spread)
    # the skew is real, but the claim is judged on the Redis clock: the replica 7 s ahead saw
    # the slot about 7 s early and was told it is not due yet; nobody sent it more than
    # beat_clock_tolerance (1 s) early. That replica says its clock is off.
    assert sent.sent_ms >= c.slot_ms - 1000, f"{sent} sent {c.slot_ms - sent.sent_ms} ms early"
    ahead = c.skew.replicas["Sp7"].log()
    assert re.search(r"WARNING.*beat replica \S+'s clock is [67]\.\d+s ahead of Redis's", ahead)
    assert "leases: beat holds cron" in ahead
    assert "WARNING" not in c.skew.replicas["S0"].log()
    (late,) = [
        d for d in c.skew.skips(beat_app.CRON_ENTRY) if (d.replica, d.run) == ("Sm5", c.slot_ms)
    ]
    assert late.at * 1000 - c.slot_ms >= -SKEWS["Sm5"] * 1000 - MAX_GAP_MS
