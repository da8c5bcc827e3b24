"""Beat dedupe with the claims on a Redis Cluster and behind Sentinel: real replicas."""

from __future__ import annotations

from collections import Counter

import pytest

from . import beat_app
from .conftest import wait_until

pytestmark = pytest.mark.worker

RUNS = 6


def test_each_interval_run_is_sent_once(make_beat_cluster, topology) -> None:
    cluster = make_beat_cluster(LEASES_BEAT_ENTRIES="every", **topology.env())
    for label in ("A", "B", "C"):
        cluster.start(label)
    cluster.wait_started()
    wait_until(lambda: len(cluster.sent(beat_app.EVERY_TASK)) >= RUNS, 60, f"{RUNS} runs sent")
    cluster.stop()

    sent = cluster.sent(beat_app.EVERY_TASK)
    claims = Counter(s.claim for s in sent)
    assert None not in claims, "a run was sent without a claim in the lease Redis"
    assert [c for c, n in claims.items() if n > 1] == [], "a run was sent twice"
    # every replica that sent a run had claimed it: its log says so
    senders = {s.replica for s in sent}
    claimed_by = {d.replica for d in cluster.claims(beat_app.EVERY_ENTRY)}
    assert senders <= claimed_by
