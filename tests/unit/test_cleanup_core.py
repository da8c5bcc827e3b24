"""The cleanup and inspection operations of the sans-IO core (_cleanup, _inspect), without Redis."""

from __future__ import annotations

from typing import Any

from celery_leases import _cleanup, _inspect
from celery_leases._engine import LeaseEngine
from celery_leases._protocol import Op, Script, Send
from celery_leases._registry import Entry
from celery_leases._scripts import ReleaseReply
from celery_leases.config import LeaseSettings
from tests.support.steps import drive, refused, replies, scripts

OWNER = "node/inc/1"


def _engine(**settings: Any) -> LeaseEngine:
    return LeaseEngine(
        LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit", **settings)
    )


def _text(resource: str, token: int, task_id: str | None = None) -> str:
    return Entry("x", token, task_id, resource).text


def test_a_cleanup_keeps_an_unreadable_entry_and_does_not_forget_the_owner():
    engine = _engine()
    members = {_text("a", 5), "not an entry"}
    steps = _cleanup.cleanup_owner(engine, OWNER)
    report, made = drive(steps, replies([members], [[ReleaseReply.RELEASED]]))
    assert report.kept == [(OWNER, "not an entry")]
    assert report.released == [(OWNER, "a")]
    assert scripts(made) == ["cmd:SMEMBERS", "release"]  # no forget_owner


def test_a_cleanup_without_surprises_forgets_the_owner_as_dead_when_asked():
    engine = _engine()
    steps = _cleanup.cleanup_owner(engine, OWNER, dead=True)
    report, made = drive(steps, replies([{_text("a", 5)}], [[ReleaseReply.NOT_HELD]], [1]))
    assert (report.released, report.expired) == ([], 1)
    assert scripts(made) == ["cmd:SMEMBERS", "release", "forget_owner"]
    assert isinstance(made[-1], Send)
    forget = made[-1].calls[0]
    assert isinstance(forget, Script)
    assert list(forget.args) == [OWNER, "node", "1"]


def test_granted_before_us_spares_a_newer_token_and_does_not_forget_the_owner():
    engine = _engine(slot_groups=2)
    steps = _cleanup.cleanup_owner(engine, OWNER, granted_before_us=1000, clock_offsets_us=[0, 50])
    # group 0: token 1000 is not before 1000 (spared); group 1: 1020 is before 1050
    answer = replies([{_text("new", 1000)}], [{_text("old", 1020)}], [[ReleaseReply.RELEASED]])
    report, made = drive(steps, answer)
    assert report.released == [(OWNER, "old")]
    assert scripts(made) == ["cmd:SMEMBERS", "cmd:SMEMBERS", "release"]  # no forget_owner


def test_a_cleanup_releases_its_entries_in_batches():
    engine = _engine()
    n = _cleanup._RELEASE_BATCH + 3
    members = [_text(f"r{i:04}", i + 1) for i in range(n)]

    def answer(op: Op) -> Any:
        assert isinstance(op, Send)
        (call,) = op.calls
        if scripts([op]) == ["cmd:SMEMBERS"]:
            return [members]
        if isinstance(call, Script) and call.name == "release":
            return [[ReleaseReply.RELEASED] * ((len(call.keys) - 2) // 5)]
        return [1]

    report, made = drive(_cleanup.cleanup_owner(engine, OWNER), answer)
    calls = [c for op in made if isinstance(op, Send) for c in op.calls]
    sizes = [
        (len(c.keys) - 2) // 5 for c in calls if isinstance(c, Script) and c.name == "release"
    ]  # the registry and lifetime record, then per lease its key, its waiter queue, its
    # tickets' expiry, its orders and its token counter
    assert sizes == [_cleanup._RELEASE_BATCH, 3]
    assert len(report.released) == n
    assert scripts(made)[-1] == "forget_owner"


def test_a_failed_owner_in_cleanup_node_is_reported_and_the_others_go_on():
    engine = _engine()
    bad, good, kept = "node/old/1", "node/old/2", "node/new/1"
    steps = _cleanup.cleanup_node(engine, "node", keep_incarnation="new")
    answer = replies(
        [{good, bad, kept}],
        refused("ERR registry"),  # bad's SMEMBERS (owners go in sorted order)
        [{_text("a", 5)}],  # good's
        [[ReleaseReply.RELEASED]],
        [1],
    )
    report, made = drive(steps, answer)
    assert report.owners == [bad, good]
    assert [owner for owner, _ in report.errors] == [bad]
    assert "failed to read an owner registry" in report.errors[0][1]
    assert report.released == [(good, "a")]
    # the node's owners, then bad's and good's registries; the kept incarnation is not read
    assert scripts(made) == ["cmd:SMEMBERS"] * 3 + ["release", "forget_owner"]


def test_holders_skips_a_shared_member_that_ran_out_by_the_redis_clock():
    engine = _engine()
    now = (1_700_000_000, 500_000)  # the Redis clock: 1_700_000_000_500 ms
    now_ms = 1_700_000_000_500
    shared = [f"7 {OWNER}", str(now_ms - 1), f"8 {OWNER}", str(now_ms + 2500)]
    steps = _inspect.holders(engine, "r")
    holders, made = drive(steps, replies([None, -2, shared, [str(now[0]), str(now[1])]]))
    assert [(h.mode, h.token, h.expires_in) for h in holders] == [("s", 8, 2.5)]
    assert scripts(made) == ["cmd:GET", "cmd:PTTL", "cmd:ZRANGE", "now"]


def test_holder_task_reads_the_registry_and_a_failure_gives_none():
    engine = _engine()
    steps = _inspect.holder_task(engine, "r")
    found, _ = drive(steps, replies([f"7 {OWNER}"], [{_text("r", 7, "task-1")}]))
    assert found == "task-1"
    missing, _ = drive(_inspect.holder_task(engine, "r"), replies(refused()))
    assert missing is None


def test_the_cluster_clocks_are_read_in_one_round_trip_and_the_offsets_never_overstate():
    engine = _engine(slot_groups=3)
    engine.cluster = True
    clocks = [["100", "0"], ["100", "5000"], ["99", "999000"]]  # 0, +5 ms, -1 ms
    (now_us, offsets), made = drive(_cleanup.clocks_us(engine), replies(clocks))
    assert now_us == 100_000_000
    assert scripts(made) == ["now", "now", "now"]
    assert len(made) == 1
    assert offsets is not None
    assert offsets[0] == 0
    assert offsets[1] <= 5000
    assert offsets[2] <= -1000
