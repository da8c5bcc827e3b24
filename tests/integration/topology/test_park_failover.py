"""Parked tasks (on_busy="defer") across a Sentinel failover: a real master killed with
SIGKILL, a replica promoted by real sentinels.

- With ``min_replicas=1`` a park is on a replica before its delivery ends (and the broker's
  message is acked): the parked tasks are all on the new master, in their order, and each is
  handed on once.
- With ``min_replicas=1`` and the replica unable to confirm, the park does not end the
  delivery: the message is requeued (``Reject``), not acked, so a failover cannot lose it.
- A failover to a replica that lagged, made deterministic: the replicas are frozen
  (``SIGSTOP``) and the master cuts their links (``CLIENT KILL TYPE replica``), so no write
  after that reaches them, not even from a socket buffer; the master is killed before they
  are let go. Without ``min_replicas`` the parks made meanwhile ended their deliveries (their
  messages acked) and are gone from the new master: the tasks are lost. With
  ``min_replicas=1`` each of those parks is refused and its message requeued; delivered again
  after the failover, it parks on the new master; delivered again before, it is requeued
  again, not dropped for the park only the master has. But with more replicas than
  ``min_replicas``, Sentinel can promote one that did not confirm (here the one that did has
  ``replica-priority 0``): the confirmed, acked parks are lost as well.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_leases import LeaseBusy, LeasedTask, Leases, _scripts
from celery_leases._keys import escape
from celery_leases._lease import Want
from celery_leases._parking import DONE_KEEP_MS, admit, defer, list_parked, tombstone
from celery_leases._scripts import ParkGateReply
from tests.support.polling import wait_until
from tests.support.topology import LocalSentinel

PARKED = 20
#: parks made before the replicas lag, and while they lag
KEPT = 3
LAGGING = 3


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
    assert deliver(leases, job, k, n, task_id) == "acked"
    return task_id


def deliver(leases: Leases, job: Any, k: str, n: int, task_id: str) -> str:
    """A delivery of ``job(k, n)`` (task id ``task_id``, its first message) finding ``pf:<k>``
    busy, as the task's defer() ends it: ``"acked"`` (``Ignore``: parked, the broker acks the
    message) or ``"requeued"`` (``Reject(requeue=True)``: the broker delivers it again)."""
    job.push_request(id=task_id, retries=0, headers={}, args=(k, n), kwargs={})
    try:
        defer(leases, job, LeaseBusy(f"pf:{k}"), [Want(f"pf:{k}")], (k, n), {}, False)
    except Ignore:
        return "acked"
    except Reject as exc:
        return "requeued" if exc.requeue else "rejected"
    finally:
        job.pop_request()
    raise AssertionError("defer() returned: the resource had room")


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


def fail_over_to_lagging_replicas(sentinel: LocalSentinel, meanwhile: Callable[[], None]) -> None:
    """Every replica has what the master has; then they are frozen and cut off, ``meanwhile``
    runs (its writes reach the master only), the master is killed, and the sentinels promote
    one of the replicas: it has none of ``meanwhile``'s writes."""
    old = sentinel.master()
    replicas = [s for s in sentinel.data if s is not old]
    with closing(redis.Redis.from_url(old.url, socket_timeout=10)) as client:
        assert client.wait(len(replicas), 10_000) == len(replicas)
        for replica in replicas:
            replica.pause()
        try:
            # the master drops their links: later writes go to no socket (a frozen replica
            # would still read what its socket buffer held once let go)
            client.client_kill_filter(_type="replica")
            meanwhile()
            old.kill()
        finally:
            for replica in replicas:
                replica.resume()
    assert sentinel.wait_for_new_master(old.port, timeout=60) in replicas


def _on_master(url: str, leases: Leases, resource: str) -> list[str]:
    """The task ids in ``resource``'s FIFO on the server at ``url``, in their order."""
    with closing(redis.Redis.from_url(url, socket_timeout=10)) as client:
        return [m.decode() for m in client.zrange(leases.store.keys.parked(resource), 0, -1)]


def _parked_ids(leases: Leases) -> list[str]:
    return [p["task_id"] for p in _parked(leases)]


def test_a_failover_to_a_lagging_replica_loses_acked_parks_without_min_replicas(
    sentinel, make
) -> None:
    leases, job = make(ttl=30.0)  # min_replicas=0, the default: replication is asynchronous
    old = sentinel.master()
    with leases.hold("pf:a") as lease:
        kept = [park_one(leases, job, "a", n) for n in range(KEPT)]
        lagging: list[str] = []

        def park_while_lagging() -> None:
            for n in range(KEPT, KEPT + LAGGING):
                lagging.append(park_one(leases, job, "a", n))  # acked: the delivery ended
            assert _on_master(old.url, leases, "pf:a") == kept + lagging

        fail_over_to_lagging_replicas(sentinel, park_while_lagging)
        # the documented non-guarantee: the parks acked meanwhile are gone, their tasks lost
        wait_until(lambda: _parked_ids(leases) == kept, 60, "the new master's parked tasks")
        assert not set(lagging) & set(_parked_ids(leases))
        lease.check()


# two replicas, both lagging: after the failover the new master has the other to confirm to
@pytest.mark.parametrize("sentinel", [2], indirect=True)
def test_a_failover_to_a_lagging_replica_loses_no_park_with_min_replicas(sentinel, make) -> None:
    leases, job = make(ttl=30.0, min_replicas=1, min_replicas_timeout=2.0)
    old = sentinel.master()
    with leases.hold("pf:a") as lease:
        kept = [park_one(leases, job, "a", n) for n in range(KEPT)]
        lagging = [str(uuid.uuid4()) for _ in range(LAGGING)]

        def park_while_lagging() -> None:
            for n, task_id in enumerate(lagging, KEPT):
                assert deliver(leases, job, "a", n, task_id) == "requeued"  # not acked
            # the parks ran on the master: acked, they would be lost like the ones above
            assert _on_master(old.url, leases, "pf:a") == kept + lagging

        fail_over_to_lagging_replicas(sentinel, park_while_lagging)
        new = sentinel.master()
        wait_until(lambda: _parked_ids(leases) == kept, 60, "the new master's parked tasks")
        wait_until(lambda: _online_replicas(new.url) >= 1, 60, "a replica of the new master")
        # the broker delivers each requeued message again: it parks, confirmed this time
        for n, task_id in enumerate(lagging, KEPT):
            assert deliver(leases, job, "a", n, task_id) == "acked"
        assert _parked_ids(leases) == kept + lagging
        lease.check()


def _online_replicas(url: str) -> int:
    with closing(redis.Redis.from_url(url, socket_timeout=10)) as client:
        info = client.info("replication")
    return sum(
        1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
        and v.get("state") == "online"
    )  # fmt: skip


def test_a_requeued_parks_redelivery_is_dropped_only_once_the_replica_has_the_park(
    sentinel, make
) -> None:
    leases, job = make(ttl=10, min_replicas=1, min_replicas_timeout=0.5)
    other, other_job = make(ttl=10, min_replicas=1, min_replicas_timeout=0.5)  # a 2nd worker
    master = sentinel.master()
    replica = next(s for s in sentinel.data if s is not master)
    task_id = str(uuid.uuid4())
    # one connection of its own: a write of this test's, confirmed by the replica
    raw = redis.Redis.from_url(master.url, socket_timeout=10, single_connection_client=True)
    with closing(raw), leases.hold("pf:a"):
        park_one(other, other_job, "a", 0)
        raw.set(f"{leases.store.keys.tag(0)}:test-probe", 1, ex=60)
        assert raw.wait(1, 10_000) == 1
        replica.pause()  # connected, but it confirms nothing more
        try:
            assert deliver(leases, job, "a", 1, task_id) == "requeued"
            assert _on_master(master.url, leases, "pf:a")[-1] == task_id  # the park stands
            # redelivered to the other worker: not dropped (acked) for a park with no replica
            assert redeliver(other, other_job, "a", 1, task_id) == "requeued"
            # whatever the connection wrote last: the gate's drop is a write of its own, so
            # the WAIT after it covers the park (a WAIT counts the connection's writes only)
            assert gate(raw, leases, "pf:a", task_id) == ParkGateReply.PARKED
            assert raw.wait(1, 300) == 0
        finally:
            replica.resume()
        # the replica has it now: the next redelivery is dropped, as a copy of a parked task
        assert redeliver(other, other_job, "a", 1, task_id) == "acked"


# two replicas, both lagging: after the failover the new master has the other to confirm to
@pytest.mark.parametrize("sentinel", [2], indirect=True)
def test_a_requeued_park_is_not_acked_on_its_redelivery_before_a_replica_has_it(
    sentinel, make
) -> None:
    leases, job = make(ttl=30.0, min_replicas=1, min_replicas_timeout=1.0)
    other, other_job = make(ttl=30.0, min_replicas=1, min_replicas_timeout=1.0)  # a 2nd worker
    old = sentinel.master()
    task_id = str(uuid.uuid4())
    with leases.hold("pf:a") as lease:
        kept = [park_one(leases, job, "a", n) for n in range(KEPT)]

        def park_and_redeliver_while_lagging() -> None:
            assert deliver(leases, job, "a", KEPT, task_id) == "requeued"
            # the park stands on the master only: its redelivery, to another worker, is not
            # dropped (acked) for it, but requeued again
            assert redeliver(other, other_job, "a", KEPT, task_id) == "requeued"
            assert _on_master(old.url, leases, "pf:a") == [*kept, task_id]

        fail_over_to_lagging_replicas(sentinel, park_and_redeliver_while_lagging)
        new = sentinel.master()
        wait_until(lambda: _parked_ids(leases) == kept, 60, "the new master's parked tasks")
        wait_until(lambda: _online_replicas(new.url) >= 1, 60, "a replica of the new master")
        # delivered once more: the gate lets it through (not parked here), and it parks
        assert redeliver(other, other_job, "a", KEPT, task_id) == "admitted"
        assert deliver(other, other_job, "a", KEPT, task_id) == "acked"
        # and a later redelivery is dropped (acked): a replica has the park now
        assert redeliver(other, other_job, "a", KEPT, task_id) == "acked"
        assert _parked_ids(leases) == [*kept, task_id]
        lease.check()


def gate(client: redis.Redis, leases: Leases, resource: str, task_id: str) -> int:
    """park_gate.lua for the first message of ``task_id``, redelivered, on ``client``."""
    keys = leases.store.keys
    state, msgs, done = keys.park_state(0), keys.park_messages(0), keys.park_done(0)
    args = [escape(task_id), DONE_KEEP_MS, tombstone(task_id, 0), "g0", "1", 1]
    script = client.register_script(_scripts.PARK_GATE)
    return int(script(keys=[state, msgs, done, keys.parked(resource)], args=args))


def redeliver(leases: Leases, job: Any, k: str, n: int, task_id: str) -> str:
    """The gate (admit()) of a redelivery of ``job(k, n)``'s first message: ``"acked"``
    (``Ignore``: dropped as a copy of a parked task), ``"requeued"`` (``Reject``), or
    ``"admitted"`` (it goes on to take its lease)."""
    job.push_request(
        id=task_id,
        retries=0,
        headers={},
        args=(k, n),
        kwargs={},
        delivery_info={"redelivered": True},
    )
    try:
        admit(leases, job, [Want(f"pf:{k}")])
    except Ignore:
        return "acked"
    except Reject as exc:
        return "requeued" if exc.requeue else "rejected"
    finally:
        job.pop_request()
    return "admitted"


# two replicas: the one that confirms every park can never be promoted (replica-priority 0)
@pytest.mark.parametrize("sentinel", [2], indirect=True)
def test_min_replicas_loses_parks_when_sentinel_promotes_a_replica_that_did_not_confirm(
    sentinel, make
) -> None:
    leases, job = make(ttl=30.0, min_replicas=1, min_replicas_timeout=2.0)
    old = sentinel.master()
    confirming, lagging_replica = [s for s in sentinel.data if s is not old]
    with closing(redis.Redis.from_url(confirming.url, socket_timeout=10)) as client:
        client.config_set("replica-priority", 0)
    wait_until(
        lambda: _sentinels_see_priority(sentinel, confirming.port, 0),
        60,
        "every sentinel to know the confirming replica can't be promoted",
    )
    with leases.hold("pf:a") as lease:
        kept = [park_one(leases, job, "a", n) for n in range(KEPT)]
        with closing(redis.Redis.from_url(old.url, socket_timeout=10)) as client:
            assert client.wait(2, 10_000) == 2
            lagging_replica.pause()
            try:
                client.client_kill_filter(_type="replica")  # the confirming one reconnects
                wait_until(lambda: _online_replicas(old.url) == 1, 60, "the confirming replica")
                # confirmed by one replica, as min_replicas=1 asks: acked
                lagging = [park_one(leases, job, "a", n) for n in range(KEPT, KEPT + LAGGING)]
                old.kill()
            finally:
                lagging_replica.resume()
        assert sentinel.wait_for_new_master(old.port, timeout=60) is lagging_replica
        # the confirmed parks are gone with the replica that was not promoted
        wait_until(lambda: _parked_ids(leases) == kept, 60, "the new master's parked tasks")
        assert not set(lagging) & set(_parked_ids(leases))
        lease.check()


def _sentinels_see_priority(sentinel: LocalSentinel, port: int, priority: int) -> bool:
    for sentinel_port in sentinel.sentinel_ports:
        url = f"redis://127.0.0.1:{sentinel_port}/0"
        with closing(redis.Redis.from_url(url, socket_timeout=5)) as client:
            replicas = client.sentinel_slaves(sentinel.master_name)
        mine = [r for r in replicas if int(r["port"]) == port]
        if not mine or int(mine[0].get("slave-priority", -1)) != priority:
            return False
    return True
