"""The unique and beat claims of the sans-IO core (celery_leases/_claims.py), without Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import _beat_claims, _claims, _grants
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._engine import LeaseEngine
from celery_leases._identity import Identity
from celery_leases._lease import Held
from celery_leases._lostreply import BOOK
from celery_leases._protocol import Command, Send
from celery_leases._registry import QUEUED_OWNER
from celery_leases._scripts import (
    BeatClaimReply,
    UniqueClaimReply,
    UniqueHandoverReply,
    UniqueRequeueReply,
)
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import LeaseSettings
from celery_leases.exceptions import LeaseBackendError
from tests.support.steps import drive, lost, refused, replies, scripts

WORKER = Identity("worker-a@host", "inca", 101)
DUE_MS = 1_700_000_000_000


def _engine() -> LeaseEngine:
    return LeaseEngine(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))


@pytest.fixture
def store() -> Iterator[LeaseStore]:
    """A store that never reaches Redis (the handover's grant records name it)."""
    s = LeaseStore(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))
    s.engine.registered[WORKER.owner] = time.monotonic()  # no home call: liveness covers
    yield s
    s.close()


def _onces(made: list[object]) -> list[bool]:
    return [op.once for op in made if isinstance(op, Send)]


# --- beat -----------------------------------------------------------------------------------
def _beat(
    engine: LeaseEngine, replica: str = "replica-a"
) -> _claims.Steps[tuple[bool, int, int, str]]:
    return _beat_claims.beat_claim(
        engine, "nightly", due_ms=DUE_MS, bucket=None, replica=replica, keep=60
    )


def test_a_beat_claim_whose_reply_is_lost_and_whose_winner_is_this_replica_is_won_once():
    engine = _engine()
    again = [[[BeatClaimReply.LOST, DUE_MS, DUE_MS + 5, "replica-a"]]]  # a Send's replies
    (won, run, _, winner), made = drive(_beat(engine), replies(lost(), *again))
    assert (won, run, winner) == (True, DUE_MS, "replica-a")
    assert scripts(made) == ["beat_claim", "beat_claim"]
    assert _onces(made) == [True, False]
    # the same run claimed again (a later tick), its reply lost once more: no second win
    (won, _, _, _), _ = drive(_beat(engine), replies(lost(), *again))
    assert not won
    # nor when the reply arrives: the claim says "lost" to anyone after the first
    (won, _, _, _), _ = drive(_beat(engine), replies(*again))
    assert not won


def test_a_beat_claim_whose_reply_is_lost_and_won_by_another_replica_is_lost():
    engine = _engine()
    reply = [BeatClaimReply.LOST, DUE_MS, DUE_MS + 5, "replica-b"]
    (won, _, _, winner), _ = drive(_beat(engine), replies(lost(), [reply]))
    assert (won, winner) == (False, "replica-b")
    assert engine.beat_won == {}


def test_a_beat_claim_refused_by_redis_is_a_backend_error_and_not_sent_again():
    with pytest.raises(LeaseBackendError, match="failed to claim a beat run"):
        drive(_beat(_engine()), replies(refused()))


def test_a_beat_claim_refused_as_early_or_future_says_why_and_from_when():
    engine = _engine()
    reply = [BeatClaimReply.FUTURE, DUE_MS, DUE_MS - 30_000, "", str(DUE_MS)]
    claim, _ = drive(
        _beat_claims.claim_beat_run(
            engine, "nightly", due_ms=DUE_MS, bucket=None, replica="a", keep=60, tolerance=1
        ),
        replies([reply]),
    )
    assert (claim.won, claim.refused, claim.retry_ms) == (False, "future", DUE_MS)
    reply = [BeatClaimReply.EARLY, 7, 14_100, "b", "15000"]
    claim, _ = drive(
        _beat_claims.claim_beat_run(engine, "tick", due_ms=None, bucket=2.0, replica="a", keep=60),
        replies([reply]),
    )
    assert (claim.won, claim.refused, claim.retry_ms, claim.winner) == (False, "early", 15000, "b")
    assert engine.beat_won == {}


def test_a_claim_key_is_read_in_its_current_and_its_older_form():
    assert _beat_claims.parse_beat_claim("17 1700000000123 beat@h/1") == (
        17,
        1700000000123,
        "beat@h/1",
    )
    assert _beat_claims.parse_beat_claim("17 beat@h 1") == (17, None, "beat@h 1")
    assert _beat_claims.parse_beat_claim("-1 5 r") == (-1, 5, "r")
    assert _beat_claims.parse_beat_claim("x r") is None


# --- unique claim ---------------------------------------------------------------------------
def test_a_unique_claim_whose_reply_is_lost_and_whose_resend_says_claimed_again_is_its_own():
    engine = _engine()
    steps = _claims.unique_claim(engine, "job:k", "task-1", 60)
    claimed, made = drive(steps, replies(lost(), [[UniqueClaimReply.CLAIMED_AGAIN, 41]]))
    assert claimed == Claimed("job:k", "task-1", 41, again=False)  # a failed publish gives it back
    assert scripts(made) == ["unique_claim", "unique_claim"]
    assert _onces(made) == [True, False]


def test_a_unique_claim_already_queued_for_the_task_by_an_earlier_publish_is_claimed_again():
    steps = _claims.unique_claim(_engine(), "job:k", "task-1", 60)
    claimed, _ = drive(steps, replies([[UniqueClaimReply.CLAIMED_AGAIN, 41]]))
    assert claimed == Claimed("job:k", "task-1", 41, again=True)


def test_a_running_holder_whose_task_id_cannot_be_read_is_looked_at_three_times():
    engine = _engine()
    busy = [UniqueClaimReply.BUSY, f"9 {WORKER.owner}", 5000]
    no_entry: set[str] = set()
    steps = _claims.unique_claim(engine, "job:k", "task-2", 60)
    holder, made = drive(steps, replies(*([[busy], [no_entry]] * 3)))
    assert isinstance(holder, ClaimHolder)
    assert (holder.state, holder.task_id, holder.owner) == ("running", None, WORKER.owner)
    assert scripts(made) == ["unique_claim", "cmd:SMEMBERS"] * 3


def test_a_queued_holder_is_read_from_the_claim_key_alone():
    steps = _claims.unique_claim(_engine(), "job:k", "task-2", 60)
    queued = f"9 {QUEUED_OWNER}task-1"
    holder, made = drive(steps, replies([[UniqueClaimReply.BUSY, queued, 1500]]))
    assert holder == ClaimHolder("job:k", "queued", "task-1", 9, None, 1.5)
    assert scripts(made) == ["unique_claim"]


# --- requeue --------------------------------------------------------------------------------
def _held(store: LeaseStore) -> Held:
    resource = store.keys.unique_resource("job:k")
    now = time.monotonic()
    return Held(store.engine, WORKER.owner, resource, "x", 7, 10, now, now, 9, task_id="task-1")


@pytest.mark.parametrize(
    ("value", "then", "requeued"),
    [
        pytest.param(f"7 {QUEUED_OWNER}task-1", [], True, id="it-ran"),
        pytest.param(f"7 {WORKER.owner}", [[UniqueRequeueReply.QUEUED]], True, id="it-did-not"),
        pytest.param(f"8 {QUEUED_OWNER}task-1", [], False, id="not-ours"),
        pytest.param(None, [], False, id="gone"),
    ],
)
def test_a_requeue_whose_reply_is_lost_reads_the_claim_back(
    store: LeaseStore, value: str | None, then: list[object], requeued: bool
):
    held = _held(store)
    steps = _claims.unique_requeue(store.engine, held, 60)
    outcome, made = drive(steps, replies(lost(), [value], *then))
    assert outcome is requeued
    expected = ["unique_requeue", "cmd:GET"] + ["unique_requeue"] * len(then)
    assert scripts(made) == expected
    get = made[1]
    assert isinstance(get, Send)
    assert get.calls == [Command(("GET", store.resource_keys(held.resource).exclusive))]


def test_a_requeue_refused_by_redis_is_a_backend_error(store: LeaseStore):
    with pytest.raises(LeaseBackendError, match="failed to queue a unique claim again"):
        drive(_claims.unique_requeue(store.engine, _held(store), 60), replies(refused()))


# --- handover -------------------------------------------------------------------------------
def _xkey(store: LeaseStore) -> str:
    return store.resource_keys(store.keys.unique_resource("job:k")).exclusive


#: what the read-back after a lost handover asks: the claim key, its shared set, the
#: registry and the Redis clock
READ_BACK = ["cmd:GET", "cmd:ZRANGE", "cmd:SMEMBERS", "now"]


def _read_back(value: str | None, registry: list[str] | None = None) -> list[object]:
    """The replies to the read-back: the claim key's ``value``, nothing else held."""
    return [value, [], registry or [], [1_700_000_000, 0]]


def test_a_handover_whose_reply_is_lost_adopts_its_own_grant(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(_grants, "new_call_id", lambda: "c1")
    steps = _claims.unique_handover(store.engine, "job:k", "task-1", WORKER, 10)
    entry = "x 77 task-1%cc1 celery_leases:unique:job:k"
    held, made = drive(steps, replies(lost(), _read_back(f"77 {WORKER.owner}", [entry])))
    assert isinstance(held, Held)
    assert (held.token, held.owner, held.task_id, held.mode) == (77, WORKER.owner, "task-1", "x")
    assert held.engine is store.engine
    assert scripts(made) == ["unique_handover", *READ_BACK]  # adopted: not sent again
    assert made[1].calls[0] == Command(("GET", _xkey(store)))  # type: ignore[union-attr]
    assert BOOK.held(WORKER.owner, _xkey(store)) == {77}
    BOOK.drop(WORKER.owner, _xkey(store), 77)


def test_a_handover_whose_lost_grant_was_not_made_is_sent_again(store: LeaseStore):
    steps = _claims.unique_handover(store.engine, "job:k", "task-1", WORKER, 10)
    answers = replies(lost(), _read_back(None), [[UniqueHandoverReply.TAKEN, 78]])
    held, made = drive(steps, answers)
    assert isinstance(held, Held)
    assert held.token == 78
    assert scripts(made) == ["unique_handover", *READ_BACK, "unique_handover"]
    assert _onces(made) == [True, False, True]  # the read may be retried, the call never
    BOOK.drop(WORKER.owner, _xkey(store), 78)
    assert BOOK.quiet(WORKER.owner, [_xkey(store)]) is not None  # the call ended


def test_a_handover_whose_reply_is_lost_twice_is_a_backend_error_and_logged(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
):
    steps = _claims.unique_handover(store.engine, "job:k", "task-1", WORKER, 10)
    with pytest.raises(LeaseBackendError, match="lost twice"):
        drive(steps, replies(lost(), _read_back(None), lost()))
    assert "could not be read back (lost again)" in caplog.text


def test_a_handover_whose_read_back_fails_is_a_backend_error_and_logged(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
):
    steps = _claims.unique_handover(store.engine, "job:k", "task-1", WORKER, 10)
    with pytest.raises(LeaseBackendError, match="failed to take over a unique claim"):
        drive(steps, replies(lost(), refused("ERR the read failed")))
    assert "could not be read back (ERR the read failed)" in caplog.text
    assert BOOK.quiet(WORKER.owner, [_xkey(store)]) is not None


def test_a_handover_in_the_restart_grace_names_the_grace(store: LeaseStore):
    steps = _claims.unique_handover(store.engine, "job:k", "task-1", WORKER, 10)
    holder, _ = drive(steps, replies([[UniqueHandoverReply.GRACE, 2500]]))
    assert holder == ClaimHolder("job:k", "grace", None, 0, None, 2.5)


def test_a_beat_claim_after_an_outage_says_skipped_missed_or_catch_up():
    engine = _engine()
    skipped = [BeatClaimReply.SKIPPED, 41, 83_000, "", "83000"]
    claim, made = drive(
        _beat_claims.claim_beat_run(
            engine, "tick", due_ms=None, bucket=2.0, replica="a", keep=60, catch_up=None
        ),
        replies([skipped]),
    )
    assert (claim.won, claim.refused, claim.run, claim.retry_ms) == (False, "skipped", 41, 83000)
    assert made[0].calls[0].args[5] == "none"  # no window: a missed run is skipped
    missed = [BeatClaimReply.MISSED, DUE_MS, DUE_MS + 90_000, "", ""]
    claim, made = drive(
        _beat_claims.claim_beat_run(
            engine,
            "nightly",
            due_ms=DUE_MS,
            bucket=None,
            replica="a",
            keep=60,
            catch_up=30.0,
            next_due_ms=DUE_MS + 60_000,
        ),
        replies([missed]),
    )
    assert (claim.won, claim.refused) == (False, "missed")
    assert made[0].calls[0].args[5:] == [30_000, str(DUE_MS + 60_000), ""]
    won = [BeatClaimReply.WON, DUE_MS, DUE_MS + 5, "a", "", "1"]
    claim, made = drive(
        _beat_claims.claim_beat_run(
            engine, "nightly", due_ms=DUE_MS, bucket=None, replica="a", keep=60, latest=True
        ),
        replies([won]),
    )
    assert (claim.won, claim.catch_up) == (True, True)
    assert made[0].calls[0].args[5:] == ["", "", "latest"]  # catch_up "": not looked for
