"""Parked tasks (on_busy="defer") across a Sentinel failover: a real master killed with
SIGKILL, a replica promoted by real sentinels.

- With ``min_replicas=1`` a park is on a replica before its delivery ends (and the broker's
  message is acked): the parked tasks are all on the new master, in their order, and each is
  handed on once.
- With ``min_replicas=1`` and the replica unable to confirm, the park does not end the
  delivery: the message is requeued (``Reject``), not acked, so a failover cannot lose it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_leases import LeaseBusy, LeasedTask, Leases
from celery_leases._lease import Want
from celery_leases._parking import defer, list_parked
from tests.support.polling import wait_until
from tests.support.topology import LocalSentinel

PARKED = 20


@pytest.fixture
def sentinel(request: pytest.FixtureRequest) -> Iterator[LocalSentinel]:
    """A Sentinel set of this test's own (the test kills its master)."""
    with LocalSentinel(replicas=getattr(request, "param", 1), sentinels=3) as s:
        yield s


@pytest.fixture
def make(sentinel: LocalSentinel) -> Iterator[Any]:
    """``make(**settings)`` -> (Leases, its deferring task ``pf.job`` on ``pf:{k}``)."""
    made: list[Leases] = []
    prefix = f"pf-{uuid.uuid4().hex[:8]}"

    def make_(**settings: Any) -> tuple[Leases, Any]:
        app = Celery(f"{prefix}-{len(made)}", broker="memory://", set_as_current=False)
        leases = Leases(app, redis_url=sentinel.url, key_prefix=prefix, **settings)
        made.append(leases)

        @app.task(
            base=LeasedTask, bind=True, name="pf.job", lease="pf:{k}", on_busy="defer", shared=False
        )
        def job(self: Any, k: str, n: int) -> None: ...

        return leases, job

    yield make_
    for leases in made:
        leases.store.close()


def park_one(leases: Leases, job: Any, k: str, n: int) -> str:
    """Park a delivery of ``job(k, n)`` on the busy ``pf:<k>`` as the task does (defer());
    its task id. Raises what defer() raises other than ``Ignore`` (the delivery ends parked)."""
    task_id = str(uuid.uuid4())
    job.push_request(id=task_id, retries=0, headers={}, args=(k, n), kwargs={})
    try:
        with pytest.raises(Ignore):
            defer(leases, job, LeaseBusy(f"pf:{k}"), [Want(f"pf:{k}")], (k, n), {}, False)
    finally:
        job.pop_request()
    return task_id


def test_min_replicas_requeues_a_park_no_replica_confirms(sentinel, make) -> None:
    leases, job = make(ttl=10.0, min_replicas=1, min_replicas_timeout=0.3)
    with leases.hold("pf:a"):
        replica = next(s for s in sentinel.data if s is not sentinel.master())
        replica.pause()
        try:
            job.push_request(id=str(uuid.uuid4()), retries=0, headers={}, args=("a", 0), kwargs={})
            try:
                with pytest.raises(Reject) as info:
                    defer(leases, job, LeaseBusy("pf:a"), [Want("pf:a")], ("a", 0), {}, False)
            finally:
                job.pop_request()
            assert info.value.requeue
            assert "replicas" in str(info.value.reason)
        finally:
            replica.resume()
        # with the replica back, a park ends the delivery (Ignore: acked)
        park_one(leases, job, "a", 1)


# two replicas: after the failover the new master still has one to confirm to
@pytest.mark.parametrize("sentinel", [2], indirect=True)
def test_parked_tasks_survive_a_failover_with_min_replicas(sentinel, make) -> None:
    leases, job = make(ttl=30.0, min_replicas=1, handon_timeout=60.0)
    old = sentinel.master()
    with leases.hold("pf:a") as lease:
        ids = [park_one(leases, job, "a", n) for n in range(PARKED)]
        old.kill()  # at once: nothing waits for the replicas but the parks' own WAIT
        sentinel.wait_for_new_master(old.port, timeout=60)
        wait_until(
            lambda: [p["task_id"] for p in _parked(leases)] == ids,
            60,
            "every parked task, in its order, on the new master",
        )
        lease.check()
    print(f"parked {PARKED}, all {len(ids)} on the new master after the failover")


def _parked(leases: Leases) -> list[Any]:
    try:
        return list_parked(leases, "pf:a")
    except Exception:  # the client finds the new master on its next try
        return []
