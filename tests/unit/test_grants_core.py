"""The grant operations of the sans-IO core (celery_leases/_grants.py), driven without Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_leases import _grants, _releases, _renew
from celery_leases._engine import LeaseEngine
from celery_leases._grants import Busy
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want
from celery_leases._lostreply import BOOK
from celery_leases._protocol import Script, Send, SendWithin
from celery_leases._registry import Entry
from celery_leases._scripts import AcquireReply, ReleaseReply
from celery_leases._sync.driver import LeaseStore
from celery_leases.config import LeaseSettings
from celery_leases.exceptions import LeaseBackendError
from tests.support.steps import drive, lost, refused, replies, scripts


def _engine() -> LeaseEngine:
    return LeaseEngine(LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit"))


def test_a_release_whose_reply_is_lost_is_sent_again_and_counts_a_held_lease_freed():
    engine = _engine()
    entry = Entry("x", 7, None, "r")
    steps = _releases.release_entries(engine, "o/1/2", 0, [entry], [True])
    freed, made = drive(steps, replies(lost(), [[ReleaseReply.NOT_HELD]]))
    assert freed == [True]  # the lost run released it; the second found nothing
    assert [op.once for op in made if isinstance(op, Send)] == [True, False]
    assert scripts(made) == ["release", "release"]


def test_a_release_refused_by_redis_is_a_backend_error_and_not_sent_again():
    engine = _engine()
    steps = _releases.release_entries(engine, "o/1/2", 0, [Entry("x", 7, None, "r")], None)
    with pytest.raises(LeaseBackendError, match="failed to release"):
        drive(steps, replies(refused()))
    assert BOOK.held("o/1/2", engine.resource_keys("r").exclusive) == set()


# --- acquire over slot groups, and the give-back of a partial grant ------------------------
WORKER = Identity("worker-a@host", "inca", 101)


@pytest.fixture
def grouped() -> Iterator[LeaseStore]:
    """A store of 4 slot groups that never reaches Redis; its owner's liveness is fresh."""
    settings = LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit", slot_groups=4)
    store = LeaseStore(settings)
    store.engine.registered[WORKER.owner] = time.monotonic()  # no home call
    yield store
    store.close()


def _in_groups(store: LeaseStore, *groups: int) -> list[str]:
    """One resource name in each of ``groups``."""
    names: list[str] = []
    for group in groups:
        names.append(
            next(n for n in (f"r{i}" for i in range(1000)) if store.resource_keys(n).group == group)
        )
    return names


def test_a_busy_later_group_gives_the_earlier_groups_grant_back(grouped: LeaseStore):
    first, second = _in_groups(grouped, 1, 2)
    steps = _grants.try_acquire(grouped.engine, [Want(first), Want(second)], WORKER, 10.0)
    granted, busy = [AcquireReply.GRANTED, 41], [AcquireReply.BUSY, 1, 500]
    outcome, made = drive(steps, replies([granted], [busy], [[ReleaseReply.RELEASED]]))
    assert outcome == Busy(second, 0.5)
    assert scripts(made) == ["acquire", "acquire", "release"]
    release = made[2].calls[0]  # type: ignore[union-attr]
    assert isinstance(release, Script)
    assert 41 in release.args
    assert grouped.resource_keys(first).exclusive in release.keys


def test_a_later_group_that_fails_gives_the_earlier_grant_back_and_raises(grouped: LeaseStore):
    first, second = _in_groups(grouped, 1, 3)
    steps = _grants.try_acquire(grouped.engine, [Want(first), Want(second)], WORKER, 10.0)
    answers = replies([[AcquireReply.GRANTED, 41]], refused(), [[ReleaseReply.RELEASED]])
    with pytest.raises(LeaseBackendError, match="failed to acquire"):
        drive(steps, answers)


def test_the_groups_go_in_ascending_order_and_the_grants_come_back_in_the_order_asked(
    grouped: LeaseStore,
):
    low, high = _in_groups(grouped, 1, 3)
    steps = _grants.try_acquire(grouped.engine, [Want(high), Want(low)], WORKER, 10.0)
    held, made = drive(steps, replies([[AcquireReply.GRANTED, 10]], [[AcquireReply.GRANTED, 20]]))
    assert isinstance(held, list)
    assert [(h.resource, h.token) for h in held] == [(high, 20), (low, 10)]
    first_call = made[0].calls[0]  # type: ignore[union-attr]
    assert grouped.resource_keys(low).exclusive in first_call.keys
    for h in held:
        BOOK.drop(WORKER.owner, grouped.resource_keys(h.resource).exclusive, h.token)


def test_a_grant_whose_reply_is_lost_is_read_back_and_adopted(
    grouped: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(_grants, "new_call_id", lambda: "c1")
    (name,) = _in_groups(grouped, 2)
    steps = _grants.try_acquire(grouped.engine, [Want(name)], WORKER, 10.0)
    entry = f"x 77 -%cc1 {name}"  # the call's own entry: its id after the task field
    read_back = [f"77 {WORKER.owner}", [], [entry], [1_700_000_000, 0]]
    held, made = drive(steps, replies(lost(), read_back))
    assert isinstance(held, list)
    assert [h.token for h in held] == [77]
    assert held[0].call == "c1"
    assert scripts(made) == ["acquire", "cmd:GET", "cmd:ZRANGE", "cmd:SMEMBERS", "now"]
    assert [op.once for op in made if isinstance(op, Send)] == [True, False]
    BOOK.drop(WORKER.owner, grouped.resource_keys(name).exclusive, 77)


def test_a_lost_grant_never_adopts_a_grant_of_its_owner_without_its_call_id(
    grouped: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    # issue 26, part 8: T held (or just released) by a sibling thread of the same owner
    monkeypatch.setattr(_grants, "new_call_id", lambda: "c2")
    (name,) = _in_groups(grouped, 2)
    steps = _grants.try_acquire(grouped.engine, [Want(name)], WORKER, 10.0)
    read_back = [f"77 {WORKER.owner}", [], [f"x 77 -%cc1 {name}"], [1_700_000_000, 0]]
    outcome, made = drive(steps, replies(lost(), read_back, [[AcquireReply.BUSY, 1, 5000]]))
    assert not isinstance(outcome, list)  # sent again, and busy: nothing adopted
    assert scripts(made) == ["acquire", "cmd:GET", "cmd:ZRANGE", "cmd:SMEMBERS", "now", "acquire"]


def test_a_grant_whose_reply_is_lost_and_was_not_made_is_sent_once_more(grouped: LeaseStore):
    (name,) = _in_groups(grouped, 2)
    steps = _grants.try_acquire(grouped.engine, [Want(name)], WORKER, 10.0)
    read_back = [None, [], [], [1_700_000_000, 0]]
    held, made = drive(steps, replies(lost(), read_back, [[AcquireReply.GRANTED, 78]]))
    assert isinstance(held, list)
    assert [h.token for h in held] == [78]
    assert scripts(made)[-1] == "acquire"
    BOOK.drop(WORKER.owner, grouped.resource_keys(name).exclusive, 78)


def test_a_renewal_reports_the_indices_redis_no_longer_has_and_refreshes_the_liveness(
    grouped: LeaseStore,
):
    a, b = _in_groups(grouped, 1, 2)
    now = time.monotonic()
    held = [
        Held(grouped.engine, WORKER.owner, name, "x", token, 10.0, now, now, 9.0)
        for name, token in ((a, 5), (b, 6))
    ]
    steps = _renew.renew(grouped.engine, held, WORKER.owner, 1.0)
    # one call per group: the home group (liveness only), then a's group, then b's
    lost_indices, made = drive(steps, replies(([[], [], [1]], [])))
    assert lost_indices == {1}
    (request,) = made
    assert isinstance(request, SendWithin)
    assert request.timeout == 1.0
    assert [call.name for call in request.calls] == ["renew", "renew", "renew"]
    assert grouped.engine.registered[WORKER.owner] >= now


def test_a_renewal_that_too_few_replicas_confirm_is_a_backend_error():
    settings = LeaseSettings(redis_url="redis://127.0.0.1:1/0", key_prefix="unit", min_replicas=1)
    store = LeaseStore(settings)
    now = time.monotonic()
    held = [Held(store.engine, WORKER.owner, "a", "x", 5, 10.0, now, now, 9.0)]
    steps = _renew.renew(store.engine, held, WORKER.owner, 1.0)
    with pytest.raises(LeaseBackendError, match="reached 0 of the 1 replicas"):
        drive(steps, replies(([[]], [0])))  # one call (the home group), WAIT says 0
    store.close()


# --- the waiter queues ---------------------------------------------------------------------
def test_a_ticket_goes_with_the_attempt_and_is_followed_to_where_it_is_blocked(
    grouped: LeaseStore,
):
    (name,) = _in_groups(grouped, 2)
    ticket = _grants.Ticket(WORKER.owner, handoff=True)
    steps = _grants.try_acquire(grouped.engine, [Want(name)], WORKER, 10.0, ticket=ticket)
    outcome, made = drive(steps, replies([[AcquireReply.BUSY, 1, 500]]))
    # one exclusive lease: the attempt left an order for a handoff, which it refreshes in time
    horizon = grouped.engine.horizon(10.0)
    assert outcome == Busy(name, 0.5, refresh=horizon / 2)
    assert ticket.ordered_at is not None
    call = made[0].calls[0]  # type: ignore[union-attr]
    assert isinstance(call, Script)
    assert ticket.id in call.args
    assert grouped.resource_keys(name).waiters in call.keys
    assert ticket.queued == {name}
    assert scripts(made) == ["acquire"]  # one group: nothing to leave


def test_a_request_blocked_in_an_earlier_group_leaves_the_queue_of_a_later_one(
    grouped: LeaseStore,
):
    first, second = _in_groups(grouped, 1, 3)
    wants = [Want(first), Want(second)]
    # an earlier attempt was blocked by `second`
    ticket = _grants.Ticket(WORKER.owner, queued={second})
    steps = _grants.try_acquire(grouped.engine, wants, WORKER, 10.0, ticket=ticket)
    outcome, made = drive(steps, replies([[AcquireReply.BUSY, 1, 500]], [[0]]))
    assert outcome == Busy(first, 0.5)
    assert scripts(made) == ["acquire", "leave"]
    leave = made[1].calls[0]  # type: ignore[union-attr]
    assert isinstance(leave, Script)
    assert grouped.resource_keys(second).waiters in leave.keys
    assert leave.args[0] == ticket.id
    assert ticket.queued == {first}


def test_a_grant_takes_the_ticket_out_of_every_queue(grouped: LeaseStore):
    (name,) = _in_groups(grouped, 2)
    ticket = _grants.Ticket(WORKER.owner, queued={name})
    steps = _grants.try_acquire(grouped.engine, [Want(name)], WORKER, 10.0, ticket=ticket)
    held, made = drive(steps, replies([[AcquireReply.GRANTED, 9]]))
    assert isinstance(held, list)
    assert ticket.queued == set()
    assert scripts(made) == ["acquire"]
    BOOK.drop(WORKER.owner, grouped.resource_keys(name).exclusive, 9)


def test_leaving_the_queues_that_fails_is_only_logged(grouped: LeaseStore):
    (name,) = _in_groups(grouped, 2)
    ticket = _grants.Ticket(WORKER.owner, queued={name})
    steps = _grants.leave_queues(grouped.engine, [Want(name)], ticket)
    outcome, made = drive(steps, replies(refused()))
    assert outcome is None
    assert scripts(made) == ["leave"]
    assert made[0].once is False  # type: ignore[union-attr]  # idempotent: may be resent
    assert ticket.queued == set()


def test_a_grant_whose_reply_cannot_be_read_leaves_no_call_in_flight():
    # the grant book ends a granting call together with its tokens (GrantBook.granted); a
    # reply that fails before that must still end the call, or a later recovery on the
    # resource would wait for it until GrantsInFlight
    engine = _engine()
    engine.store = None  # type: ignore[assignment]  # the Held records are never used here
    key = engine.resource_keys("r").exclusive
    steps = _grants.acquire_group(engine, 0, [Want("r")], WORKER, 30.0, True)
    with pytest.raises(ValueError, match="shorter"):  # "granted" without its token
        drive(steps, replies([[AcquireReply.GRANTED]]))
    assert BOOK.quiet(WORKER.owner, [key]) is not None
    assert BOOK.held(WORKER.owner, key) == set()
