"""The periodic orphan reconcile: a node that never comes back, live nodes, several reconcilers.

A node killed for good leaves leases that no restart will clean; a live worker's reconcile
frees them once the dead owner's liveness (the node's ``ttl`` setting) has run out, long before
the leases' own TTL. A live worker's leases are never reconciled away, and two workers never
run a reconcile pass at the same time (the ``celery_leases:reconcile`` lease).

The reconcile passes are traced by ``worker_app`` (``LEASES_TEST_TRACE_RECONCILE``): each pass is
counted in the ledger, and so is each bid for the reconcile lease.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from .conftest import kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: the liveness of the nodes' owners (their ``ttl`` setting), in seconds
LIVENESS = 2.0
#: the lease TTL of ``worker_app.long_lease``
LEASE_TTL = 60.0
#: seconds between the reconcile passes of one worker (counted from the end of the last one)
INTERVAL = 0.4
#: seconds each traced reconcile pass stays open. A worker's timer starts the next pass INTERVAL
#: after the end of the last, so each worker is inside a pass PASS_PAUSE / (PASS_PAUSE +
#: INTERVAL) of the time: more than half, so two workers cannot fall into turns by chance and
#: their passes would overlap without the reconcile lease.
PASS_PAUSE = 0.6


class Trace:
    """The reconcile trace that ``worker_app`` writes to the ledger."""

    def __init__(self, client: redis.Redis, ledger: Any) -> None:
        self.client, self.ledger = client, ledger

    def passes(self) -> list[str]:
        return list(self.client.lrange(self.ledger.key("reconcile", "passes"), 0, -1))

    def bids(self) -> list[str]:
        return list(self.client.lrange(self.ledger.key("reconcile", "bids"), 0, -1))

    def overlaps(self) -> int:
        return int(self.client.get(self.ledger.key("reconcile", "overlaps")) or 0)


def _reconciler_env(pause: float = PASS_PAUSE, interval: float = INTERVAL) -> dict[str, str]:
    return {
        "CELERY_LEASES_TTL": str(LIVENESS),
        "CELERY_LEASES_RECONCILE_INTERVAL": str(interval),
        "LEASES_TEST_TRACE_RECONCILE": str(pause),
    }


def test_dead_node_leases_are_freed_by_a_live_reconciler_before_their_ttl(
    start_worker: Any,
    worker_app: Any,
    send: Any,
    queue: str,
    test_leases: Any,
    ledger: Any,
    leases_redis: redis.Redis,
) -> None:
    store = test_leases.store
    trace = Trace(leases_redis, ledger)
    # the live worker consumes another queue: it only reconciles
    live = start_worker(
        "threads", 1, env=_reconciler_env(pause=0.0, interval=1.0), extra=["-Q", f"{queue}-idle"]
    )
    doomed = start_worker(
        "prefork",
        1,
        env={"CELERY_LEASES_TTL": str(LIVENESS), "CELERY_LEASES_RECONCILE_INTERVAL": "0"},
    )
    rid = "orphan"
    resource = f"res:{rid}"
    send(worker_app.long_lease, rid, 300)
    ledger.wait_event(f"started:{rid}")
    (held,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    assert held.node == doomed.hostname
    # the doomed node is alive: passes run meanwhile and leave its lease alone
    passes_before = len(trace.passes())
    wait_until(lambda: len(trace.passes()) >= passes_before + 2, 10, "two reconcile passes")
    assert [h.token for h in store.holders(resource)] == [held.token]

    kill_whole_worker(doomed)
    killed_at = time.monotonic()
    (orphan,) = store.holders(resource)
    assert orphan.token == held.token
    assert orphan.expires_in > LEASE_TTL / 2

    def freed() -> bool:
        return not store.holders(resource)

    try:
        wait_until(freed, orphan.expires_in / 2, f"the reconcile to free {resource}")
    except AssertionError as exc:
        liveness = dict(store.owners()).get(held.owner)
        raise AssertionError(
            f"{exc}; the dead owner {held.owner} still has {liveness}s of liveness "
            f"(the node's ttl setting is {LIVENESS}s, the lease's {LEASE_TTL}s)"
        ) from None
    freed_after = time.monotonic() - killed_at
    # freed by the live worker's reconcile, not by its TTL
    assert freed_after < orphan.expires_in / 2
    live.wait_for_log(f"orphan reconcile released 1 lease(s): {resource}", 10)
    assert held.owner not in store.node_owners(doomed.hostname)
    assert held.owner not in dict(store.owners())
    # the resource can be taken again at once (no worker serves this queue any more)
    with test_leases.hold(resource) as lease:
        assert lease.token > held.token


def test_live_worker_keeps_its_lease_across_reconcile_passes(
    start_worker: Any,
    worker_app: Any,
    send: Any,
    test_leases: Any,
    ledger: Any,
    leases_redis: redis.Redis,
) -> None:
    store = test_leases.store
    trace = Trace(leases_redis, ledger)
    # the lease and the owner's liveness both live LIVENESS seconds: only the heartbeat of a
    # live worker keeps them, while the reconcile runs every INTERVAL
    worker = start_worker("prefork", 1, env=_reconciler_env(pause=0.0))
    rid = "alive"
    resource = f"res:{rid}"
    seconds = 4 * LIVENESS
    result = send(worker_app.sleeper, rid, seconds)
    ledger.wait_event(f"started:{rid}")
    (held,) = wait_until(lambda: store.holders(resource), 10, f"a holder of {resource}")
    wait_until(lambda: ledger.active(resource), 10, "the body to enter")
    passes_at_start = len(trace.passes())
    samples = 0

    def sample() -> bool:
        # every sample taken while the body runs must show the same holder and token. The body
        # is known to run only if it is still inside after the read: its lease is released
        # after it leaves and before Celery stores the result (t0 the body leaves; t1 the
        # finalizer releases; t2 a sample reads no holder; t3 the result is stored), so
        # result.ready() cannot tell (a busy machine once failed here that way)
        nonlocal samples
        holders = store.holders(resource)
        if not ledger.active(resource):
            return True
        assert [(h.owner, h.token) for h in holders] == [(held.owner, held.token)], (
            f"{resource} changed hands while its task ran: {holders}"
        )
        samples += 1
        return False

    wait_until(sample, seconds + 20, "the task to finish")
    out = result.get(timeout=10)
    assert out["leases"] == [[resource, held.token]]
    passes = len(trace.passes()) - passes_at_start
    assert passes >= 3, f"only {passes} reconcile passes ran while the task held its lease"
    assert samples >= 10
    assert ledger.events(f"lost:{rid}") == []
    assert "orphan reconcile released" not in worker.log()
    assert "leases: lost" not in worker.log()


def test_two_reconcilers_never_run_a_pass_at_once(
    start_worker: Any,
    test_leases: Any,
    ledger: Any,
    leases_redis: redis.Redis,
) -> None:
    trace = Trace(leases_redis, ledger)
    env = _reconciler_env()
    a = start_worker("prefork", 1, env=env)
    b = start_worker("threads", 1, env=env)

    # both bid from the start; wait until both have bid a few times and passes piled up
    def enough() -> bool:
        bids = trace.bids()
        return len(trace.passes()) >= 8 and all(
            sum(bid.startswith(f"{w.hostname} ") for bid in bids) >= 3 for w in (a, b)
        )

    wait_until(enough, 30, "eight reconcile passes and three bids of each worker")
    a.stop()
    b.stop()
    passes, bids = trace.passes(), trace.bids()
    assert trace.overlaps() == 0, f"reconcile passes overlapped: {passes}"
    won = [bid for bid in bids if bid.endswith(" won")]
    assert len(won) == len(passes), f"bids {bids}, passes {passes}"
    # the workers did contend: some bids found the other worker's pass running
    assert any(bid.endswith(" busy") for bid in bids), f"no bid ever found the lease taken: {bids}"
    assert test_leases.store.holders("celery_leases:reconcile") == []
