"""Leader mode with real ``celery beat`` replicas: one replica sends, another takes over.

Two replicas in ``beat_mode="leader"`` with a lease TTL of 2 s and an entry every second. Only
the replica holding the leader lease sends; when it is killed with SIGKILL, the lease runs out
on its own and the other replica takes over and sends from then on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_leases import Leases
from celery_leases.beat import LEADER_RESOURCE

from . import beat_app
from .conftest import BeatCluster, BeatProc, gaps_ms, wait_until

pytestmark = pytest.mark.worker

TTL = 2.0
INTERVAL_MS = round(beat_app.INTERVAL * 1000)
#: the leader lease runs out at most one TTL after the kill; the standby bids for it at each of
#: its due runs (one interval apart), and one more interval is allowed for the send itself
TAKEOVER_MS = round(TTL * 1000) + 2 * INTERVAL_MS
#: the lease was renewed at most TTL/3 before the kill, so it lives on at least 2/3 of the TTL
#: after it (minus a late renewal); the standby must not send before it has run out
NOT_BEFORE_MS = round(TTL * 1000 / 3)
MAX_GAP_MS = 2 * INTERVAL_MS


def _leader(cluster: BeatCluster) -> BeatProc | None:
    leaders = [b for b in cluster.replicas.values() if b.alive and b.leader_since()]
    assert len(leaders) <= 1, f"two leaders at once: {[b.label for b in leaders]}"
    return leaders[0] if leaders else None


def test_only_the_leader_sends_and_the_standby_takes_over_after_kill(
    make_beat_cluster: Callable[..., BeatCluster], make_leases: Callable[..., Leases]
) -> None:
    cluster = make_beat_cluster(
        CELERY_LEASES_BEAT_MODE="leader",
        CELERY_LEASES_TTL=str(TTL),
        LEASES_BEAT_ENTRIES="every",
    )
    store = make_leases().store  # this test's prefix, to look at the leader lease
    for label in ("L1", "L2"):
        cluster.start(label)
    cluster.wait_started()

    leader: BeatProc = wait_until(lambda: _leader(cluster), TTL + 5, "a leader")
    (standby,) = [b for b in cluster.replicas.values() if b is not leader]
    wait_until(lambda: len(cluster.sent(beat_app.EVERY_TASK)) >= 4, 10, "four runs from the leader")
    (holder,) = store.holders(LEADER_RESOURCE)
    assert holder.owner.endswith(f"/{leader.pid}"), f"{holder} is not the leader {leader.pid}"

    killed_ms = leader.kill9(cluster.redis_ms)
    wait_until(lambda: _leader(cluster) is standby, TAKEOVER_MS / 1000 + 5, "the takeover")
    wait_until(
        lambda: (
            len([s for s in cluster.sent(beat_app.EVERY_TASK) if s.replica == standby.label]) >= 4
        ),
        10,
        "four runs from the new leader",
    )
    (holder,) = store.holders(LEADER_RESOURCE)
    assert holder.owner.endswith(f"/{standby.pid}"), f"{holder} is not the new leader"
    cluster.stop()  # SIGTERM: the leader gives the lease back as it shuts down
    assert store.holders(LEADER_RESOURCE) == []

    sends = cluster.sent(beat_app.EVERY_TASK)
    before = [s for s in sends if s.sent_ms < killed_ms]
    after = [s for s in sends if s.sent_ms >= killed_ms]
    # only the leader sent, and the standby never did before the kill (nor logged a send)
    assert len(before) >= 4
    assert {s.replica for s in before} == {leader.label}
    assert {s.pid for s in before} == {leader.pid}
    assert [t for t in standby.sending(beat_app.EVERY_ENTRY) if t * 1000 < killed_ms] == []
    assert standby.leader_since()[0] * 1000 >= killed_ms
    # the standby took over once the lease had run out, within the TTL and an interval
    assert {s.replica for s in after} == {standby.label}
    took = after[0].sent_ms - killed_ms
    assert NOT_BEFORE_MS <= took <= TAKEOVER_MS, f"took over {took} ms after the kill"
    # and sends from then on, every interval
    long_gaps = [(g, a, b) for g, a, b in gaps_ms(after) if g > MAX_GAP_MS]
    assert not long_gaps, f"gaps longer than {MAX_GAP_MS} ms after the takeover: {long_gaps}"
    gaps_before = [g for g, _, _ in gaps_ms(before)]
    assert max(gaps_before) <= MAX_GAP_MS
