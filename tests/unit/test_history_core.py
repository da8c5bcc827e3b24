"""The history's script arguments and its reads, in the sans-IO core, driven without Redis."""

from __future__ import annotations

from celery_leases import _grants, _inspect, _releases
from celery_leases._engine import RESOURCE_HISTORY, LeaseEngine
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._registry import Entry
from celery_leases.config import LeaseSettings
from tests.support.steps import drive, replies, scripts

WORKER = Identity("worker-a@host", "inca", 101)


def _engine(**settings: object) -> LeaseEngine:
    return LeaseEngine(
        LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit", **settings)
    )


def test_the_history_arguments_come_last_and_its_keys_only_when_on(monkeypatch):
    monkeypatch.setattr(_grants, "new_call_id", lambda: "c1")
    off, on = _engine(), _engine(history=500, history_keep=60.0)
    wants = [Want("a"), Want("b", "s", 2)]
    plain = _grants.acquire_call(off, 0, wants, WORKER, 30.0, False)
    kept = _grants.acquire_call(on, 0, wants, WORKER, 30.0, False)
    # every earlier argument in its place; without history a "0" alone, with it the three of
    # the history, the group's cap last
    assert plain.args[:-1] == kept.args[:-3]
    assert plain.args[-1] == 0
    assert kept.args[-3:] == [min(500, RESOURCE_HISTORY), 60_000, 500]
    assert kept.keys[: len(plain.keys)] == plain.keys
    ra, rb = on.resource_keys("a"), on.resource_keys("b")
    assert kept.keys[len(plain.keys) :] == [
        on.keys.history(0),
        ra.history,
        ra.record,
        rb.history,
        rb.record,
    ]
    # the home call alone writes no event: no history key
    home = _grants.acquire_call(on, 0, [], WORKER, 30.0, True)
    assert on.keys.history(0) not in home.keys


def test_a_release_names_its_event_and_who_frees_last():
    on = _engine(history=500)
    entries = [Entry("x", 7, "t1", "a")]
    args = _releases.release_args(on, "o/1/2", entries, "freed", "reaper")
    plain = _releases.release_args(_engine(), "o/1/2", entries, "freed", "reaper")
    assert args[:-5] == plain[:-1]
    assert plain[-1] == 0  # without history, neither the event nor who frees is sent
    assert args[-5:] == [100, 86_400_000, "freed", "reaper", 500]
    keys = _releases.release_keys(on, "o/1/2", 0, entries)
    rk = on.resource_keys("a")
    assert keys[-3:] == [on.keys.history(0), rk.history, rk.record]
    assert on.keys.history(0) not in _releases.release_keys(_engine(), "o/1/2", 0, entries)


def test_an_event_is_read_from_its_stream_entry():
    event = _inspect.parse_event(
        "1796153908566-0",
        [
            "e",
            "freed",
            "x",
            "x 42 task%201 r:1 with space",
            "o",
            "celery@pod-8/inc/77",
            "by",
            "ops",
        ],
    )
    assert event == {
        "id": "1796153908566-0",
        "event": "freed",
        "resource": "r:1 with space",
        "mode": "exclusive",
        "at": 1796153908.566,
        "owner": "celery@pod-8/inc/77",
        "node": "celery@pod-8",
        "pid": 77,
        "task_id": "task 1",
        "token": 42,
        "by": "ops",
    }
    busy = _inspect.parse_event("5-1", {"e": "busy", "x": "s 0 - r", "o": "n/i/1", "w": "250"})
    assert (busy["token"], busy["wait"], busy["task_id"]) == (None, 0.25, None)


def test_without_the_setting_history_reads_nothing():
    events, made = drive(_inspect.history(_engine(), count=10), replies())
    assert events == []
    assert made == []


def test_the_fleet_history_merges_the_groups_newest_first():
    engine = _engine(history=100, slot_groups=2)
    group0 = [("30-0", ["e", "granted", "x", "x 3 - a", "o", "n/i/1"])]
    group1 = [
        ("40-0", ["e", "released", "x", "x 2 - b", "o", "n/i/1"]),
        ("10-0", ["e", "granted", "x", "x 2 - b", "o", "n/i/1"]),
    ]
    events, made = drive(_inspect.history(engine, count=2), replies([group0, group1]))
    assert [e["id"] for e in events] == ["40-0", "30-0"]
    assert scripts(made) == ["cmd:XREVRANGE", "cmd:XREVRANGE"]
