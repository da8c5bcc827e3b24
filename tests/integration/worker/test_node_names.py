"""A worker's start-up cleanup frees only its own dead incarnations, never a live beat's lease.

``celery beat`` runs as the ``celery`` console script, like a worker started without ``-n``
(``celery@<host>``). Timeline of the bug: t0 a worker ``celery@<host>`` holds a lease and is
killed with SIGKILL; t1 a beat in leader mode on the same host takes the leader lease; t2 the
worker starts again as ``celery@<host>`` and its start-up cleanup frees what the earlier
incarnations of ``celery@<host>`` held. The beat's lease must not be among them.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from celery_leases.beat import LEADER_RESOURCE
from tests.integration.beat.conftest import BeatCluster

from .conftest import kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: far longer than the test, so that no lease here can end by expiry
LEASE_TTL = "60"


def test_worker_start_up_cleanup_spares_a_live_beat_of_the_same_host(
    start_worker: Any,
    worker_app: Any,
    send: Any,
    test_leases: Any,
    ledger: Any,
    leases_redis_url: str,
    leases_prefix: str,
    tmp_path: Path,
) -> None:
    store = test_leases.store
    host = socket.gethostname()
    # the default worker name, as `celery worker` gives it without -n
    worker = start_worker("prefork", 1, hostname="celery@%h", env={"CELERY_LEASES_TTL": LEASE_TTL})
    node = f"celery@{host}"
    rid = "predecessor"
    resource = f"res:{rid}"
    send(worker_app.sleeper, rid, 300)
    ledger.wait_event(f"started:{rid}")
    (dead,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    assert dead.node == node
    kill_whole_worker(worker)  # the dead predecessor: its lease stays until a cleanup

    # same prefix and Redis; its own queue, so that the worker never receives its runs
    (tmp_path / "beat").mkdir()
    cluster = BeatCluster(
        leases_redis_url, leases_prefix, f"beat-{leases_prefix}", tmp_path / "beat"
    )
    try:
        beat = cluster.start(
            "leader",
            console_script=True,
            env={
                "CELERY_LEASES_BEAT_MODE": "leader",
                "CELERY_LEASES_TTL": LEASE_TTL,
                "LEASES_BEAT_ENTRIES": "every",
            },
        )
        beat.wait_for_log("is the leader", 30)
        (leader,) = store.holders(LEADER_RESOURCE)

        worker.start()  # celery@<host> again; returns once "ready." is logged
        log = worker.current_log()
        cleanup = f"start-up cleanup of earlier incarnations of {node} released"
        assert cleanup in log
        assert log.index(cleanup) < log.index("ready.")

        # the beat still leads, with the same lease: nobody freed it, nobody took it over
        assert [(h.owner, h.token) for h in store.holders(LEADER_RESOURCE)] == [
            (leader.owner, leader.token)
        ], f"the worker's start-up freed the beat's leader lease:\n{log[-3000:]}"
        assert leader.owner in store.node_owners(leader.node)
        # because the beat is named as a beat, not as the worker celery@<host>
        assert leader.node == f"celery:beat:{beat.pid}@{host}"
        # and the worker's own dead predecessor was cleaned
        assert store.holders(resource) == [], f"{resource} of the dead incarnation still held"
        assert f"{cleanup} 1 lease(s): {resource}\n" in log
        assert beat.alive
        assert "lost the leader lease" not in beat.log()
    finally:
        cluster.close()
