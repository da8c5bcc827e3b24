"""The scripts of tasks parked on a rate limit against a real Redis: park_limit.lua,
handon_limit.lua and park_gate.lua driven in the order a race would, no worker."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from celery_leases import Leases, RateLimited, _parking
from celery_leases._keys import escape
from celery_leases._parking import (
    DONE_KEEP_MS,
    _call,
    _group_keys,
    _limit_script_keys,
    list_parked,
    tombstone,
    unpark,
)
from celery_leases._scripts import HANDON_LIMIT, PARK_GATE, PARK_LIMIT, ParkGateReply, ParkReply
from tests.support.topologies import leases_factory
from tests.support.topology import LocalCluster

NAME = "rlp:L"
N, PERIOD_US = 3, 1_000_000  # "3/s"
HANDON_MS = 300
MEMBER = f"r {N}:{PERIOD_US}:1 {NAME}"


def park(ext: Leases, task: str, consumed: bool = False, generation: int = 0) -> ParkReply:
    state, msgs, done, due = _group_keys(ext, ext.store.keys.group_of(NAME))
    reply = _call(
        ext,
        PARK_LIMIT,
        [*_limit_script_keys(ext, NAME), state, msgs, done, due],
        [
            escape(task),
            N,
            PERIOD_US,
            1,
            f'{{"resource": "{NAME}", "task": "t", "on": "limit"}}',
            MEMBER,
            DONE_KEEP_MS,
            "1" if consumed else "0",
            tombstone(task, 0),
            f"g{generation}",
        ],
        "park",
    )
    return ParkReply(int(reply[0]))


def hand_on(ext: Leases) -> tuple[str | None, int]:
    """handon_limit.lua once: (the task id handed on, or None; the due ms it set)."""
    group = ext.store.keys.group_of(NAME)
    state, msgs, _, due = _group_keys(ext, group)
    registry = ext.store.engine.registry_key(ext.identity().owner, group)
    reply = _call(
        ext,
        HANDON_LIMIT,
        [*_limit_script_keys(ext, NAME), state, msgs, due, registry],
        [N, PERIOD_US, 1, HANDON_MS, MEMBER, 60_000],
        "hand on",
    )
    if int(reply[0]) == 1:
        raw = reply[1]
        return (raw.decode() if isinstance(raw, bytes) else str(raw)), 0
    return None, int(reply[1])


def gate(ext: Leases, task: str, generation: int = 0, redelivered: bool = False) -> ParkGateReply:
    state, msgs, done, _ = _group_keys(ext, ext.store.keys.group_of(NAME))
    keys = [state, msgs, done, ext.store.keys.parked_limit(NAME)]
    # a delivery of the task's message of that generation (see park_gate.lua)
    again = "1" if redelivered else "0"
    args = [escape(task), DONE_KEEP_MS, tombstone(task, 0), f"g{generation}", again, 0]
    raw = _call(ext, PARK_GATE, keys, args, "gate")
    return ParkGateReply(int(raw))


def admit(ext: Leases) -> bool:
    try:
        ext.limit(NAME, "3/s")
    except RateLimited:
        return False
    return True


def fifo(ext: Leases) -> list[str]:
    client = ext.store.client
    members = client.zrange(ext.store.keys.parked_limit(NAME), 0, -1)
    return [m.decode() if isinstance(m, bytes) else str(m) for m in members]


def fill(ext: Leases) -> None:
    """Take every admission the window has room for."""
    while admit(ext):
        pass


def wait_for_room(ext: Leases, deadline: float = 30.0) -> None:
    """Until the window is empty again (a period after the last admission)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        log = ext.store.keys.limit_keys(NAME)[0]
        if not ext.store.client.zcard(log):
            return
        time.sleep(0.05)
    raise AssertionError("the window never emptied")


def test_parks_only_when_refused_and_hands_on_only_the_room(leases: Leases):
    assert park(leases, "first") == ParkReply.FREE  # room, nobody ahead: admit again
    fill(leases)
    for task in ("t1", "t2", "t3", "t4", "t5"):
        assert park(leases, task) == ParkReply.PARKED
    assert park(leases, "t1") == ParkReply.PARKED_ALREADY  # a copy of a parked task
    assert gate(leases, "t1") == ParkGateReply.PARKED
    task, due = hand_on(leases)
    assert task is None
    assert 0 < due <= 1000  # full: the exact wait, within the period
    wait_for_room(leases)
    handed = [hand_on(leases)[0] for _ in range(3)]
    assert handed == ["t1", "t2", "t3"]  # in order, as many as the window has room for
    task, due = hand_on(leases)
    assert task is None  # the hand-ons in flight hold the room: nothing more
    assert 0 < due <= 1000
    assert park(leases, "late") == ParkReply.PARKED  # room is promised: a newcomer parks
    rows = {p["task_id"]: p for p in list_parked(leases, NAME)}
    assert {rows[t]["state"] for t in ("t1", "t2", "t3")} == {"handed on"}
    assert {p["on"] for p in rows.values()} == {"limit"}


def test_a_copy_refused_parks_again_at_the_head_and_a_lost_hand_on_goes_last(leases: Leases):
    fill(leases)
    for task in ("t1", "t2", "t3", "t4"):
        assert park(leases, task) == ParkReply.PARKED
    wait_for_room(leases)
    assert [hand_on(leases)[0] for _ in range(3)] == ["t1", "t2", "t3"]
    # t1's copy starts: it consumes its hand-on (once) and is admitted
    assert gate(leases, "t1") == ParkGateReply.HANDED
    assert gate(leases, "t1") == ParkGateReply.CONSUMED  # a second copy: dropped
    assert admit(leases)
    # another caller takes the room t2's hand-on was given: t2's copy is refused, re-parks first
    assert gate(leases, "t2") == ParkGateReply.HANDED
    fill(leases)
    assert park(leases, "t2", consumed=True) == ParkReply.PARKED
    assert fifo(leases)[:2] == ["t2", "t4"]
    # t3's copy never comes: its hand-on runs out, and it goes to the end of the FIFO
    time.sleep(HANDON_MS / 1000 + 0.2)
    wait_for_room(leases)
    assert [hand_on(leases)[0] for _ in range(3)] == ["t2", "t4", "t3"]
    # a late copy of t3's first hand-on consumes the second one: it runs, once
    assert gate(leases, "t3") == ParkGateReply.HANDED
    assert "t3" not in fifo(leases)


def test_unpark_and_an_empty_fifo_leave_nothing_due(leases: Leases):
    fill(leases)
    assert park(leases, "t1") == ParkReply.PARKED
    assert unpark(leases, "t1")
    assert gate(leases, "t1") == ParkGateReply.CONSUMED  # a copy published before: dropped
    wait_for_room(leases)
    assert hand_on(leases) == (None, 0)
    due = _group_keys(leases, leases.store.keys.group_of(NAME))[3]
    assert leases.store.client.zscore(due, MEMBER) is None
    assert fifo(leases) == []


def test_on_a_redis_cluster(redis_cluster: LocalCluster, leases_prefix: str):
    # the limit's keys and its FIFO live in the slot group of its name: one slot per script
    with leases_factory(redis_cluster.url, leases_prefix, slot_groups=8) as make:
        ext = make()
        assert ext.store.keys.group_of(NAME) != 0
        fill(ext)
        for task in ("c1", "c2"):
            assert park(ext, task) == ParkReply.PARKED
        wait_for_room(ext)
        assert [hand_on(ext)[0] for _ in range(2)] == ["c1", "c2"]
        assert gate(ext, "c1") == ParkGateReply.HANDED
        assert [p["task_id"] for p in list_parked(ext, NAME)] == ["c2"]


class Killed(BaseException):
    """Stands in for a kill -9 between a hand-on and its publish: nothing after it runs."""


def handon_entries(ext: Leases) -> list[str]:
    registry = ext.store.engine.registry_key(ext.identity().owner, ext.store.keys.group_of(NAME))
    return [str(m) for m in ext.store.client.smembers(registry) if str(m).startswith("p ")]


def test_a_dead_pumps_hand_on_is_taken_over_by_a_cleanup(
    make_leases: Callable[..., Leases], monkeypatch: pytest.MonkeyPatch
) -> None:
    # t0 the pump hands the limit on to t1 (its hand-on in flight holds t1's room and turn);
    # t1 it is killed before it publishes t1; t2 a cleanup of it takes the hand-on over:
    # t1 is published at once, keeping its turn, not left for handon_timeout (300 s here)
    ext = make_leases(handon_timeout=300)
    store = ext.store
    fill(ext)
    for task in ("t1", "t2"):
        assert park(ext, task) == ParkReply.PARKED
    wait_for_room(ext)

    def die() -> None:
        raise Killed

    monkeypatch.setattr(_parking, "_die_here_for_a_test", die)
    with pytest.raises(Killed):
        _parking._hand_on_limit(ext, f"{N}:{PERIOD_US}:1", NAME, None)
    [entry] = handon_entries(ext)
    mark, stamp, task, rest = entry.split(" ", 3)
    assert (mark, task, rest) == ("p", "t1", f"r 0 {NAME}")
    assert abs(int(stamp) / 1e6 - store.redis_time()) < 60
    fifo_key = store.keys.parked_limit(NAME)
    ends = store.client.zscore(fifo_key, "t1")

    report = store.cleanup_node(ext.identity().node)
    assert [(o, t) for o, t, _ in report.handons] == [(ext.identity().owner, "t1")]
    assert '"on": "limit"' in report.handons[0][2]  # its message, to publish
    assert handon_entries(ext) == []
    # still in flight (its turn and its room kept), for a full handon_timeout from now
    assert store.client.zscore(fifo_key, "t1") >= ends
    assert store.cleanup_owner(ext.identity().owner, dead=True).handons == []
    # the copy consumes the hand-on and runs; t2 is the next one handed on
    assert gate(ext, "t1") == ParkGateReply.HANDED
    assert hand_on(ext)[0] == "t2"


def test_a_takeover_of_a_limits_hand_on_that_ran_out_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch, leases: Leases
) -> None:
    fill(leases)
    assert park(leases, "t1") == ParkReply.PARKED
    wait_for_room(leases)
    assert hand_on(leases)[0] == "t1"  # recorded; its hand-on runs out in HANDON_MS
    time.sleep(HANDON_MS / 1000 + 0.1)
    report = leases.store.cleanup_owner(leases.identity().owner, dead=True)
    assert report.handons == []  # its copy may come late: its next hand-on is its turn
    assert handon_entries(leases) == []


def test_a_task_parked_again_on_a_limit_is_no_longer_its_hand_ons_consumer(leases: Leases):
    # the original message (g0) of t1, redelivered, consumes t1's hand-on, is refused and
    # parks again; its worker dies before the ack. t1 is handed on again and its copy (g1)
    # consumes that. The original, redelivered once more, must be dropped: it is not the
    # consumer any more (park_limit.lua removes the "@g0" record, as park.lua does)
    fill(leases)
    assert park(leases, "t1") == ParkReply.PARKED
    wait_for_room(leases)
    assert hand_on(leases)[0] == "t1"
    assert gate(leases, "t1", generation=0, redelivered=True) == ParkGateReply.HANDED
    fill(leases)
    assert park(leases, "t1", consumed=True, generation=0) == ParkReply.PARKED
    wait_for_room(leases)
    assert hand_on(leases)[0] == "t1"
    assert gate(leases, "t1", generation=1) == ParkGateReply.HANDED
    assert gate(leases, "t1", generation=0, redelivered=True) == ParkGateReply.CONSUMED
    # the copy that consumed it, redelivered, still passes
    assert gate(leases, "t1", generation=1, redelivered=True) == ParkGateReply.HANDED
