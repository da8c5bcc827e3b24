"""The scripts of parked tasks against a real Redis: the hazards of docs/parking.md, one by one.

No worker here: each test drives park.lua, handon.lua, park_gate.lua and acquire.lua in the
order a race would, and checks that nothing is lost and nothing runs twice.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from celery import Celery, uuid
from celery.exceptions import Ignore
from kombu.utils.json import dumps, loads

from celery_leases import LeaseBusy, LeasedTask, Leases, _parking
from celery_leases._identity import Identity
from celery_leases._keys import escape
from celery_leases._lease import Want
from celery_leases._parking import (
    DONE_KEEP_MS,
    PLACEHOLDER,
    _call,
    _group_keys,
    list_parked,
    tombstone,
    unpark,
)
from celery_leases._scripts import HANDON, PARK, PARK_GATE, ParkGateReply, ParkReply

HANDON_MS = 300


def other(leases: Leases, name: str) -> Identity:
    ident = leases.identity()
    return Identity(name, ident.incarnation, ident.pid)


def park(
    ext: Leases,
    task: str,
    want: Want,
    consumed: bool = False,
    retries: int = 0,
    force: bool = False,
    wait_ms: int = 1,
    generation: int = 0,
) -> ParkReply:
    keys = ext.store.keys
    state, msgs, done, due = _group_keys(ext, keys.group_of(want.resource))
    reply = _call(
        ext,
        PARK,
        [
            keys.exclusive(want.resource),
            keys.shared(want.resource),
            keys.parked(want.resource),
            state,
            msgs,
            done,
            due,
        ],
        [
            escape(task),
            want.mode,
            want.limit,
            f'{{"resource": "{want.resource}", "task": "t"}}',
            f"{want.mode} {want.limit} {want.resource}",
            DONE_KEEP_MS,
            "1" if consumed else "0",
            tombstone(task, retries),
            "1" if force else "0",
            wait_ms,
            f"g{generation}",
        ],
        "park",
    )
    return ParkReply(int(reply[0]))


def hand_on(ext: Leases, want: Want) -> str | None:
    """handon.lua once: the task id handed on, or None."""
    keys = ext.store.keys
    state, msgs, _, due = _group_keys(ext, keys.group_of(want.resource))
    reply = _call(
        ext,
        HANDON,
        [
            keys.exclusive(want.resource),
            keys.shared(want.resource),
            keys.parked(want.resource),
            state,
            msgs,
            due,
            ext.store.engine.registry_key(ext.identity().owner, keys.group_of(want.resource)),
        ],
        [
            want.mode,
            want.limit,
            HANDON_MS,
            f"{want.mode} {want.limit} {want.resource}",
            PLACEHOLDER,
            60_000,
        ],
        "hand on",
    )
    return str(reply[1]) if int(reply[0]) == 1 else None


def gate(
    ext: Leases,
    task: str,
    want: Want,
    retries: int = 0,
    generation: int = 0,
    redelivered: bool = False,
) -> ParkGateReply:
    """park_gate.lua for a message of ``task`` (its lease_parked ``generation``)."""
    keys = ext.store.keys
    state, msgs, done, _ = _group_keys(ext, keys.group_of(want.resource))
    reply = _call(
        ext,
        PARK_GATE,
        [state, msgs, done, keys.parked(want.resource)],
        [
            escape(task),
            DONE_KEEP_MS,
            tombstone(task, retries),
            f"g{generation}",
            "1" if redelivered else "0",
            1,  # one lease's FIFO
        ],
        "gate",
    )
    return ParkGateReply(int(reply))


def take(ext: Leases, want: Want, task: str, owner: str = "copy") -> bool:
    """One acquire of ``want`` by a process ``owner`` running ``task``; True if granted."""
    got = ext.store.try_acquire([want], other(ext, owner), 5.0, task)
    return isinstance(got, list)


X = Want("db")


def test_hazard1_a_release_between_the_busy_acquire_and_the_park_is_not_missed(leases: Leases):
    with leases.hold("db"):
        assert not take(leases, X, "t1")  # t0: the task's acquire finds db busy
    # t1: the holder released (it found nobody parked: no hand-on); t2: the task parks
    assert park(leases, "t1", X) == ParkReply.FREE  # it acquires again instead
    assert not list_parked(leases)
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
    # the release came after the park: the head is handed on
    assert hand_on(leases, X) == "t1"


def test_hazard2_a_redelivery_of_a_parked_task_is_dropped(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
        # the parking worker died before its ack: the broker delivers the original again
        assert gate(leases, "t1", X) == ParkGateReply.PARKED
        assert park(leases, "t1", X) == ParkReply.PARKED_ALREADY
    assert [p["task_id"] for p in list_parked(leases)] == ["t1"]


def test_hand_on_reserves_the_lease_for_the_task_only(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
        assert park(leases, "t2", X) == ParkReply.PARKED
    assert hand_on(leases, X) == "t1"
    assert hand_on(leases, X) is None  # reserved: nothing more to hand on
    # a newcomer cannot overtake the task handed on
    assert not take(leases, X, "newcomer", "n")
    with pytest.raises(LeaseBusy):
        leases.acquire([X])
    assert gate(leases, "t1", X) == ParkGateReply.HANDED
    assert take(leases, X, "t1")
    assert [p["task_id"] for p in list_parked(leases)] == ["t2"]


def test_shared_limit_hands_on_one_per_free_place(leases: Leases):
    want = Want("erp", "s", 2)
    assert take(leases, want, "h1", "h1")
    assert take(leases, want, "h2", "h2")
    for t in ("t1", "t2", "t3"):
        assert park(leases, t, want) == ParkReply.PARKED
    assert hand_on(leases, want) is None  # full
    # free both places (as the holders' releases would): each hands on one head, in order
    keys = leases.store.keys
    leases.store.client.delete(keys.shared("erp"))
    assert hand_on(leases, want) == "t1"
    assert hand_on(leases, want) == "t2"
    assert hand_on(leases, want) is None  # two reservations: full again
    assert not take(leases, want, "newcomer", "n")


def test_hazard3_a_hand_on_never_published_is_handed_on_again(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
        assert park(leases, "t2", X) == ParkReply.PARKED
    assert hand_on(leases, X) == "t1"  # the releaser dies before it publishes t1
    time.sleep(HANDON_MS / 1000 + 0.1)
    # the reservation ran out unclaimed: the pump passes on to t2, and t1 goes to the end
    assert hand_on(leases, X) == "t2"
    assert gate(leases, "t2", X) == ParkGateReply.HANDED
    assert take(leases, X, "t2")
    leases.store.client.delete(leases.store.keys.exclusive("db"))
    assert hand_on(leases, X) == "t1"  # published again: nothing lost


def test_hazard4_two_copies_of_one_hand_on_run_once(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
    assert hand_on(leases, X) == "t1"
    # the releaser published, died before recording it, and a takeover published again
    assert gate(leases, "t1", X) == ParkGateReply.HANDED  # the first copy consumes it
    assert gate(leases, "t1", X) == ParkGateReply.CONSUMED  # the second is dropped
    assert park(leases, "t1", X) == ParkReply.CONSUMED  # even if it got as far as parking
    # the copy that consumed it may park again (its reservation ran out meanwhile)
    time.sleep(HANDON_MS / 1000 + 0.1)
    with leases.hold("db"):
        assert park(leases, "t1", X, consumed=True) == ParkReply.PARKED


def test_unpark_drops_later_copies(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
    assert hand_on(leases, X) == "t1"
    assert unpark(leases, "t1")
    assert gate(leases, "t1", X) == ParkGateReply.CONSUMED
    assert not list_parked(leases)


def test_a_retry_of_a_task_that_ran_from_a_hand_on_is_not_dropped(leases: Leases):
    with leases.hold("db"):
        assert park(leases, "t1", X) == ParkReply.PARKED
    assert hand_on(leases, X) == "t1"
    assert gate(leases, "t1", X) == ParkGateReply.HANDED
    assert gate(leases, "t1", X) == ParkGateReply.CONSUMED  # a copy of that message
    # the body called self.retry(): the same id, one retry more, a new message
    assert gate(leases, "t1", X, retries=1) == ParkGateReply.NOT_PARKED


def park_real(ext: Leases, app: Celery, resource: str, n: int) -> str:
    """Park a real ``park_app.excl`` message on ``resource`` (as defer() does): its task id."""
    sig = app.tasks["park_app.excl"].s(resource.split(":", 1)[1], n).set(task_id=uuid())
    want = Want(resource, "x", 0)
    keys = ext.store.keys
    state, msgs, done, due = _group_keys(ext, keys.group_of(resource))
    message = dumps({"resource": resource, "task": "park_app.excl", "sig": dict(sig)})
    lease_keys = [keys.exclusive(resource), keys.shared(resource), keys.parked(resource)]
    args = [escape(sig.id), "x", 0, message, f"x 0 {resource}", DONE_KEEP_MS, "0"]
    reply = _call(
        ext, PARK, [*lease_keys, state, msgs, done, due], [*args, tombstone(sig.id, 0)], "park"
    )
    assert ParkReply(int(reply[0])) == ParkReply.PARKED, want
    return str(sig.id)


def published_ids(client: redis.Redis, queue: str) -> list[str]:
    return [loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)]


def test_arelease_hands_on_as_release_does(producer: Celery, queue: str) -> None:
    # no worker, so no pump: only the release can hand on here
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    client = redis.Redis.from_url(producer.conf.broker_url)
    try:
        with ext.hold("excl:S"):
            sync_id = park_real(ext, producer, "excl:S", 1)
        [entry] = list_parked(ext, "excl:S")
        assert entry["state"] == "handed on"
        assert published_ids(client, queue) == [sync_id]

        async def held() -> str:
            async with ext.ahold("excl:A"):
                task_id = park_real(ext, producer, "excl:A", 2)
            await ext.aclose()
            return task_id

        async_id = asyncio.run(held())
        [entry] = list_parked(ext, "excl:A")
        assert entry["task_id"] == async_id
        assert entry["state"] == "handed on"
        assert published_ids(client, queue) == [async_id, sync_id]
        # and the reservation is that task's: anybody else finds excl:A busy
        with pytest.raises(LeaseBusy):
            ext.acquire([Want("excl:A", "x", 0)])
    finally:
        client.close()


class Killed(BaseException):
    """Stands in for a kill -9 between a hand-on and its publish: nothing after it runs."""


def handon_entries(client: redis.Redis, ext: Leases, resource: str) -> list[bytes]:
    owner = ext.identity().owner
    registry = ext.store.engine.registry_key(owner, ext.store.keys.group_of(resource))
    return [m for m in client.smembers(registry) if m.startswith(b"p ")]


def test_a_dead_releasers_hand_on_is_taken_over_by_a_cleanup(
    producer: Celery, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    store = ext.store
    me = ext.identity()
    client = redis.Redis.from_url(producer.conf.broker_url)
    try:
        # a releaser that publishes leaves no record behind
        with ext.hold("excl:P"):
            park_real(ext, producer, "excl:P", 0)
        assert handon_entries(client, ext, "excl:P") == []
        client.delete(queue)

        # this process holds nothing and is not registered (as a worker's main process running
        # the pump, once a reconcile forgot it when its liveness ran out)
        held = store.acquire([Want("excl:T", "x", 0)], other(ext, "holder"), 30.0)
        task_id = park_real(ext, producer, "excl:T", 1)
        store.cleanup_owner(me.owner, dead=True)
        store.engine.registered.pop(me.owner, None)
        assert me.owner not in store.node_owners(me.node)
        store.release(held)  # freed without a hand-on (a holder that died, a cleanup)

        def die() -> None:
            raise Killed

        monkeypatch.setattr(_parking, "_die_here_for_a_test", die)
        with pytest.raises(Killed):
            _parking.hand_on_released(ext, ["excl:T"])
        # handed on, not published; recorded where a cleanup of this process looks
        [entry] = list_parked(ext, "excl:T")
        assert entry["state"] == "handed on"
        assert published_ids(client, queue) == []
        # its wire format: "p <Redis us> <escaped task id> <mode> <limit> <resource>"
        [record] = handon_entries(client, ext, "excl:T")
        mark, stamp, task, rest = record.decode().split(" ", 3)
        assert (mark, task, rest) == ("p", escape(task_id), "x 0 excl:T")
        assert abs(int(stamp) / 1e6 - store.redis_time()) < 60
        assert me.owner in store.node_owners(me.node)

        # the cleanup of its node (a restart) takes the hand-on over: published now, once
        report = store.cleanup_node(me.node)
        assert [(o, t) for o, t, _ in report.handons] == [(me.owner, task_id)]
        assert handon_entries(client, ext, "excl:T") == []
        assert _parking.publish_taken_over(ext, report) == 1
        assert published_ids(client, queue) == [task_id]
        assert store.cleanup_owner(me.owner, dead=True).handons == []
        # the copy finds its hand-on (its reservation stands) and runs
        assert gate(ext, task_id, Want("excl:T", "x", 0)) == ParkGateReply.HANDED
    finally:
        client.close()


def test_a_newcomer_parks_behind_parked_tasks_even_when_the_resource_is_free(leases: Leases):
    # t0 a holder releases R with T parked on it; t1 newcomer N's gate, before the hand-on:
    # R is free, but N must park behind T rather than take R (it would overtake T)
    want = Want("behind", "x", 0)
    assert take(leases, want, "-", owner="holder")
    assert park(leases, "T", want) == ParkReply.PARKED
    leases.store.client.delete(leases.store.keys.exclusive(want.resource))  # the release
    assert gate(leases, "N", want) == ParkGateReply.BEHIND
    assert park(leases, "N", want) == ParkReply.PARKED
    # once T is handed on (R reserved for it), the next newcomer is behind N, not behind T
    assert hand_on(leases, want) == "T"
    assert gate(leases, "M", want) == ParkGateReply.BEHIND
    assert gate(leases, "T", want) == ParkGateReply.HANDED
    # with nothing parked any more, a newcomer goes on to its acquire
    assert unpark(leases, "N")
    assert gate(leases, "M", want) == ParkGateReply.NOT_PARKED


def test_a_redelivered_copy_that_finds_its_lease_busy_parks_again(
    leases_redis_url: str, leases_prefix: str
) -> None:
    """A copy that consumed its hand-on, started and was killed is redelivered (acks_late):
    its lease is busy (held by its dead run until a cleanup, or taken since). It must park
    again, not be dropped for the tombstone its own run left: that lost the task."""
    app = Celery("redelivered", broker="memory://", set_as_current=False)
    ext = Leases(app, redis_url=leases_redis_url, key_prefix=leases_prefix)
    # the scripts' side, in an app whose releases do not hand on (the test hands on)
    plain = Leases(Celery("plain", set_as_current=False), redis_url=leases_redis_url,
                   key_prefix=leases_prefix)  # fmt: skip

    @app.task(bind=True, base=LeasedTask, name="p.job", lease="db", on_busy="defer", shared=False)
    def job(self: LeasedTask) -> None: ...

    try:
        with plain.hold("db"):
            assert park(plain, "t1", X) == ParkReply.PARKED
        assert hand_on(plain, X) == "t1"
        assert gate(plain, "t1", X) == ParkGateReply.HANDED  # the copy starts...
        assert take(plain, X, "t1", owner="dead")
        # ...and dies holding the lease; its redelivery comes while the lease is busy
        job.push_request(
            id="t1", retries=0, headers={}, args=(), kwargs={}, lease_parked=1,
            delivery_info={"redelivered": True},
        )  # fmt: skip
        try:
            consumed, behind = _parking.admit(ext, job, [X])
            assert behind is None
            with pytest.raises(Ignore):
                _parking.defer(ext, job, LeaseBusy("db"), [X], (), {}, consumed)
        finally:
            job.pop_request()
        assert [p["task_id"] for p in list_parked(ext, "db")] == ["t1"]
        # parked: any other copy of it is dropped until it is handed on again
        assert gate(plain, "t1", X) == ParkGateReply.PARKED
    finally:
        ext.store.close()
        plain.store.close()
