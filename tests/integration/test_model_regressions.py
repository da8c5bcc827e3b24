"""Bugs the model-based test (test_model.py) found, each shrunk to a deterministic test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Task
from celery.exceptions import Ignore, Reject
from redis import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_leases import (
    LeaseBusy,
    Leases,
    _grants,
    _limiter,
    _limits,
    _parking,
    _scripts,
    _taskflow,
)
from celery_leases._claims import Claimed
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._parking import PLACEHOLDER, _group_keys
from celery_leases._scripts import ParkGateReply, ParkReply
from celery_leases._sync.driver import LeaseStore
from tests.integration.parking.test_park_scripts import gate, hand_on, other, park, take
from tests.support.polling import wait_until

LIVENESS = 3.0  # the ttl setting
A = Identity("worker-a@host", "inca", 101)
B = Identity("worker-b@host", "incb", 202)


def test_a_unique_handover_refreshes_a_liveness_that_would_end_before_its_horizon(
    make_leases_store: Callable[..., LeaseStore],
) -> None:
    """A reconcile must never free a claim whose holder still counts it held.

    Found by the model: t0 the owner renews (its liveness runs to t0 + 3 s); t1 = t0 + 1.5 it
    takes over a unique claim with ttl=3: the handover skipped the home call since the
    owner registered less than 2.7 s ago, but its lease counts held until t1 + 2.7 =
    t0 + 4.2; t0 + 3 the liveness runs out; a reconcile frees the claim while its holder
    still counts it held for 1.2 s, and another worker can start a second copy of the task.
    """
    store = make_leases_store(ttl=LIVENESS)
    store.renew([], A.owner, timeout=5.0)  # registers A and refreshes its liveness
    time.sleep(LIVENESS / 2)
    assert isinstance(store.unique_claim("report:1", "task-1", 60), Claimed)
    held = store.unique_handover("report:1", "task-1", A, LIVENESS)
    assert isinstance(held, Held)
    deadline = held.deadline  # until then the holder counts the claim held

    # wait for A's liveness to run out, or until shortly before the deadline if it never does
    def liveness_ended() -> bool:
        left = store.read_liveness([A.owner])[A.owner]
        return left is None or left <= 0 or time.monotonic() >= deadline - 0.3

    wait_until(liveness_ended, 2 * LIVENESS, "A's liveness to run out")
    report = store.reconcile()
    ended = time.monotonic()

    if ended < deadline:  # (a machine too slow to get here in time shows nothing)
        assert report.released == [], f"freed {deadline - ended:.2f}s before the deadline"
        assert store.unique_holder("report:1") is not None
    store.release([held])


def test_a_shared_lease_that_ran_out_is_not_released_again(
    make_leases_store: Callable[..., LeaseStore],
) -> None:
    """Releasing a shared lease that already ran out says so (False), as for an exclusive one.

    Found by the model: a shared holder's member stays in the sorted set after its score
    passed until the next acquire of that resource sweeps it out, and release.lua counted
    its ZREM as a release. So ``release`` returned True for a lease that had run out, and a
    reconcile reported it among the leases it freed instead of the expired ones.
    """
    store = make_leases_store()
    # another holder keeps the sorted set alive (alone, a member goes with the set's expiry)
    (other,) = store.acquire([Want("r", "s")], B, 60)
    (held,) = store.acquire([Want("r", "s")], A, 0.1)
    (gone,) = store.acquire([Want("q", "s")], A, 0.1)
    store.acquire([Want("q", "s")], B, 60)
    wait_until(
        lambda: [h.owner for h in store.holders("r") + store.holders("q")] == [B.owner] * 2,
        5.0,
        "A's leases to run out",
    )

    assert store.release([held]) == [False]
    report = store.cleanup_owner(A.owner, dead=True)
    assert report.released == []
    assert report.expired == 1  # the entry of A's lease on "q"
    assert gone.resource == "q"
    assert other.token in [h.token for h in store.holders("r")]
    store.cleanup_owner(B.owner, dead=True)


def _reserve(leases: Leases, want: Want, task: str) -> None:
    """Park ``task`` on ``want`` (busy now), free the resource, hand it on: the lease is
    reserved for ``task`` (the placeholder holder "0 %parked/<task>")."""
    blockers = [
        leases.store.acquire([want], Identity(f"blocker-{i}@host", "b", 300 + i), 60)
        for i in range(max(want.limit, 1))
    ]
    assert park(leases, task, want) == ParkReply.PARKED
    for held in blockers:
        leases.store.release(held)
    assert hand_on(leases, want) == task
    assert [h.owner for h in leases.store.holders(want.resource)] == [f"{PLACEHOLDER}{task}"]


def test_a_task_handed_on_to_a_shared_lease_takes_over_its_reservation(leases: Leases) -> None:
    """A hand-on's reservation of a shared place is taken over by its task, whatever room
    the lease has besides.

    Found by the model: acquire.lua took over the reservation only when the shared lease
    was full without it. A task handed on to a ``Shared(limit=2)`` lease with the other
    place free was granted a second place beside its own reservation: it counted twice,
    and a newcomer was refused although one task held the lease.
    """
    want = Want("erp:1", "s", 2)
    _reserve(leases, want, "t1")
    assert gate(leases, "t1", want) == ParkGateReply.HANDED
    assert take(leases, want, "t1")
    holders = leases.store.holders(want.resource)
    assert [h.owner for h in holders] == [other(leases, "copy").owner], holders
    assert take(leases, want, "t2", owner="newcomer")  # the second place is free


def test_a_task_handed_on_is_not_queued_behind_a_waiter(
    leases: Leases, leases_redis: Redis
) -> None:
    """A hand-on's reservation is its task's turn: a waiter queued meanwhile (a task of
    ``on_busy="wait"``) does not refuse it.

    Found by the model: acquire.lua took the reservation over but then found the waiter at
    the head of the resource's queue, refused the task, which parked again; the reservation
    blocked the waiter too until ``handon_timeout``.
    """
    want = Want("db")
    engine = leases.store.engine
    waiter = Identity("waiter@host", "w", 400)
    # a ticket without an order (as for a wait for several resources): a release wakes its
    # waiter instead of handing it the lease
    ticket = _grants.Ticket(waiter.owner, None, False)
    # the waiter listens: a release wakes it and leaves its ticket queued (nobody listening,
    # the release would drop the ticket)
    pubsub = leases_redis.pubsub()
    pubsub.subscribe(leases.store.keys.waiter_channel(ticket.id))
    wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, 5.0, "SUBSCRIBE")
    with leases.hold("db"):
        assert park(leases, "t1", want) == ParkReply.PARKED
        busy = leases.store.run(_grants.try_acquire(engine, [want], waiter, 60, ticket=ticket))
        assert isinstance(busy, _grants.Busy)  # queued
    assert hand_on(leases, want) == "t1"
    assert gate(leases, "t1", want) == ParkGateReply.HANDED
    assert take(leases, want, "t1")
    pubsub.close()


def test_a_shared_task_handed_on_in_the_exclusive_mode_leaves_no_reservation(
    leases: Leases, leases_redis: Redis
) -> None:
    """A task takes over its reservation in whichever mode the hand-on made it.

    Found by the model: tasks of both modes parked on one resource share its FIFO, which is
    handed on in the mode of the caller (the releaser's lease, or the pump's due member). A
    shared task handed on by an exclusive hand-on found its reservation in the exclusive
    key; acquire.lua granted its shared place and left the exclusive placeholder: one task
    held the resource in both modes, and nobody else could have it until the reservation
    ran out. (handon.lua now hands each task on in the mode park.lua recorded for it; a task
    parked without that record, by an earlier version, is still handed on in the caller's.)
    """
    shared, exclusive = Want("erp:2", "s", 2), Want("erp:2")
    with leases.hold("erp:2"):
        assert park(leases, "t1", shared) == ParkReply.PARKED
        assert park(leases, "t2", exclusive) == ParkReply.PARKED
    # t1 was parked by an earlier version: no mode recorded for it
    msgs = _group_keys(leases, leases.store.keys.group_of("erp:2"))[1]
    assert leases_redis.hdel(msgs, "%mt1") == 1
    assert hand_on(leases, exclusive) == "t1"  # the head, handed on exclusively
    assert gate(leases, "t1", shared) == ParkGateReply.HANDED
    assert take(leases, shared, "t1")
    holders = leases.store.holders(shared.resource)
    assert [(h.mode, h.owner) for h in holders] == [("s", other(leases, "copy").owner)], holders


def test_a_deferring_task_behind_a_dead_waiters_ticket_parks_and_is_handed_on(
    leases: Leases, leases_redis: Redis
) -> None:
    """A deferring task refused for what park.lua does not see parks all the same.

    Found by the model: a resource without holders whose waiter queue is headed by the ticket
    of a waiter that died (or within a restart grace) refuses the task's acquire, while
    park.lua, which looks at the holders only, found room and told it to acquire again: five
    times, then the task failed with LeaseBusy. A second refusal now parks it (``force``),
    due when the refusal said; the hand-on's reservation is the task's turn in the queue.
    """
    want = Want("db")
    engine = leases.store.engine
    dead = Identity("dead-waiter@host", "w", 500)
    ticket = _grants.Ticket(dead.owner, None, False)
    pubsub = leases_redis.pubsub()
    pubsub.subscribe(leases.store.keys.waiter_channel(ticket.id))
    wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, 5.0, "SUBSCRIBE")
    with leases.hold("db"):
        busy = leases.store.run(_grants.try_acquire(engine, [want], dead, 60, ticket=ticket))
        assert isinstance(busy, _grants.Busy)  # its ticket is queued
    pubsub.close()  # woken by the release, the waiter dies before its next attempt
    assert not take(leases, want, "t1")  # refused: the dead waiter heads the queue
    assert park(leases, "t1", want) == ParkReply.FREE  # park.lua sees no holder
    assert not take(leases, want, "t1")
    assert park(leases, "t1", want, force=True, wait_ms=50) == ParkReply.PARKED
    time.sleep(0.1)
    assert hand_on(leases, want) == "t1"  # the pump, when due
    assert gate(leases, "t1", want) == ParkGateReply.HANDED
    assert take(leases, want, "t1")


def test_a_lost_park_reply_requeues_the_message_instead_of_retrying(
    leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A park whose reply is lost ends the delivery with a requeue, never a retry.

    Suspected, then confirmed: park.lua ran (the task is parked under its tombstone
    "<id>#0") and its reply was lost; the task layer retried the task (on_backend_error),
    a new message "<id>#1" that the gate lets through once the task is handed on or ran:
    the task ran twice. Requeued, the same message meets the gate: dropped while parked.
    """

    def deferred(self: Any) -> None:
        """Never runs here."""

    task = leases.app.task(name="reg.deferred", bind=True, shared=False)(deferred)
    want = Want("db")
    lost: list[str] = []

    def lose_the_reply(
        ext: Leases, src: str, keys: Any, args: Any, what: str, wait: str = ""
    ) -> Any:
        reply = real_call(ext, src, keys, args, what, wait)
        if src == _scripts.PARK and not lost:
            lost.append(what)
            raise ext.store.backend_error(what, RedisTimeoutError("reply lost"))
        return reply

    real_call = _parking._call
    monkeypatch.setattr(_parking, "_call", lose_the_reply)
    task.push_request(id="t1", retries=0, delivery_info={}, headers={}, args=(), kwargs={})
    try:
        with leases.hold("db"):
            with pytest.raises(Reject):
                _parking.defer(leases, task, LeaseBusy("db", 1.0), [want], (), {}, False)
            assert lost
            # the requeued message comes back: the task is parked, so it is dropped
            with pytest.raises(Ignore):
                _parking.admit(leases, task, [want])
    finally:
        task.pop_request()
    assert [p["task_id"] for p in _parking.list_parked(leases)] == ["t1"]


def test_a_fifo_of_both_modes_hands_each_task_on_in_its_own_mode(leases: Leases) -> None:
    """A hand-on reserves the lease in the mode its task asked for, not the caller's.

    Found by the model: tasks of both modes parked on one resource share its FIFO, and
    handon.lua reserved in the mode of whoever handed on. An exclusive task handed on by a
    shared hand-on (the pump's due member of a shared task) got a shared place while another
    shared task was handed on beside it: its acquire was refused beside its own
    reservation, and it parked again behind it.
    """
    shared, exclusive = Want("erp:3", "s", 2), Want("erp:3")
    with leases.hold("erp:3"):
        assert park(leases, "t1", exclusive) == ParkReply.PARKED
        assert park(leases, "t2", shared) == ParkReply.PARKED
    assert hand_on(leases, shared) == "t1"  # the head: handed on in its own mode
    assert hand_on(leases, shared) is None  # t2 must wait: t1 is exclusive
    assert gate(leases, "t1", exclusive) == ParkGateReply.HANDED
    assert take(leases, exclusive, "t1")
    holders = leases.store.holders(shared.resource)
    assert [(h.mode, h.owner) for h in holders] == [("x", other(leases, "copy").owner)], holders


def test_a_redelivered_original_whose_gate_reply_was_lost_runs(leases: Leases) -> None:
    """A message whose gate consumed the hand-on but lost its reply runs when requeued.

    Suspected, then confirmed: a parked task's original message is delivered again (its
    worker died after the park, before the ack) once the task was handed on; its gate
    consumes the hand-on and the reply is lost; the message is requeued (Reject), and the
    gate then found the hand-on consumed: an original (no lease_parked header) was dropped,
    and so was the published copy when it came: the task never ran. park_gate.lua now
    records which message consumed a hand-on (its generation), and tells that message so
    when it is delivered again.
    """
    want = Want("db")
    with leases.hold("db"):
        assert park(leases, "t1", want) == ParkReply.PARKED  # the original, generation 0
    assert hand_on(leases, want) == "t1"  # its copy (generation 1) is on its way
    # the original, redelivered: its gate runs (the reply is lost), it is requeued
    assert gate(leases, "t1", want, redelivered=True) == ParkGateReply.HANDED
    assert gate(leases, "t1", want, redelivered=True) == ParkGateReply.HANDED  # runs
    # the published copy comes: dropped (a fresh copy of a consumed hand-on)
    assert gate(leases, "t1", want, generation=1) == ParkGateReply.CONSUMED
    assert take(leases, want, "t1")


@pytest.mark.parametrize("mode", ["s", "x"])
def test_a_grant_with_riding_limits_runs_once_when_redis_lost_the_limit_script(
    make_leases: Callable[..., Leases], make_redis_server: Callable[..., Any], mode: str
) -> None:
    """A grant runs once even when a limit riding in its round trip meets NOSCRIPT.

    Found by the model (its rule ``limited_task``, after its Redis restarted): the script
    cache of a Redis that restarted (or ran SCRIPT FLUSH) is refilled one script at a time,
    as each is first called. A task's grant (``acquire``, loaded again by an earlier grant)
    carried its limit check (``limit``, not loaded yet) in one pipeline: the grant ran, the
    check answered NOSCRIPT, and the whole pipeline was sent again, so the grant ran twice.
    A shared lease was granted twice (one grant never reported, held until its ttl ran out);
    an exclusive one was refused "held by" the task itself, which kept the first grant.
    """
    server = make_redis_server()  # a private server: its script cache is ours to empty
    leases = make_leases(redis_url=server.url)
    want = Want("r", mode)
    leases.release(leases.acquire([want], ttl=60))  # loads acquire (and release), not limit
    limits = [_limits.want("api", "3/s", 1)]
    granted = _limiter.take(leases, limits, [want], 60.0, 0.0, "task-1", None)
    try:
        holders = leases.store.holders("r")
        assert [(h.mode, h.token) for h in holders] == [(mode, granted[0].token)], holders
    finally:
        leases.release(granted)


def test_a_task_handed_on_by_its_rate_limit_runs_after_it_ran_from_a_lease_hand_on(
    make_leases: Callable[..., Leases],
) -> None:
    """A deferring task with a lease and a rate limit in two slot groups runs when its limit
    hands it on, after an earlier copy consumed a hand-on of its lease.

    Found by the model: T parks on its busy lease (group a); the release hands it on and its
    copy consumes the hand-on (T's tombstone in group a's done set); the limit, riding with
    the grant, refuses: T parks on the limit (group b). When the limit hands it on, the
    copy's gate asked group a first, found the tombstone ("already ran from its hand-on") and
    dropped the copy; the hand-on ran out, T was handed on again, dropped again: T never ran
    and stayed "handed on" on the limit.
    """
    leases = make_leases(slot_groups=4)
    keys = leases.store.keys
    limit = _limits.want("api:0", "1/s", 1, "api")
    resource = next(
        f"r:{i}" for i in range(100) if keys.group_of(f"r:{i}") != keys.group_of(limit.name)
    )
    published: list[int] = []

    class Captured(Task):  # type: ignore[misc]
        def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> None:
            headers = options.get("headers") or {}
            published.append(int(headers[_parking.PARKED_HEADER]))

    def body(self: Any) -> None: ...

    task = leases.app.task(
        name="reg.limited", bind=True, base=Captured, on_busy="defer", shared=False
    )(body)

    def deliver(generation: int | None) -> list[Any] | None:
        """One delivery of T (a copy of that generation): its leases if it runs."""
        headers = {} if generation is None else {_parking.PARKED_HEADER: generation}
        task.push_request(
            id="T", retries=0, delivery_info={"redelivered": False}, headers=headers,
            args=(), kwargs={}, **headers,
        )  # fmt: skip
        try:
            outcome = _taskflow.take_or_park(
                leases, leases, task, [Want(resource)], [limit], ttl=30.0, wait=0.0,
                on_lost=None, deferring=True, args=(), kwargs={},
            )  # fmt: skip
        except Ignore:
            return None
        finally:
            task.pop_request()
        assert isinstance(outcome, list), outcome
        return outcome

    holder = leases.acquire([Want(resource)], ttl=30)
    assert deliver(None) is None  # parked on its busy lease
    leases.release(holder)  # hands T on: its copy is published
    assert published == [1]
    leases.store.run(_limits.admit(leases.store.engine, [limit]))  # the limit is full
    assert deliver(1) is None  # consumes the lease's hand-on; the limit refuses: parked
    assert [p["on"] for p in _parking.list_parked(leases)] == ["limit"]
    wait_until(lambda: _parking.pump(leases) > 0, 10, "the limit hands T on")
    assert published == [1, 2]
    granted = deliver(2)
    assert granted is not None, f"the copy was dropped: {_parking.list_parked(leases)}"
    leases.release(granted)
