"""Unique claims in the store, on a real Redis: claim, handover, requeue, unclaim, cleanup."""

from __future__ import annotations

import threading

import pytest
import redis

from celery_leases import _claims
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._engine import LeaseEngine
from celery_leases._identity import Identity
from celery_leases._lease import Held
from celery_leases._protocol import Steps
from celery_leases._sync.driver import LeaseStore
from celery_leases.exceptions import LeaseConfigError
from tests.support.cluster import hash_tag
from tests.support.polling import wait_until

A = Identity("worker-a@host", "inca", 101)
B = Identity("worker-b@host", "incb", 202)


def test_a_second_task_is_refused_while_the_first_is_queued(leases_store: LeaseStore):
    first = leases_store.unique_claim("report:42", "task-1", 60)
    assert isinstance(first, Claimed)
    assert not first.again

    second = leases_store.unique_claim("report:42", "task-2", 60)

    assert isinstance(second, ClaimHolder)
    assert (second.state, second.task_id, second.token) == ("queued", "task-1", first.token)
    assert second.owner is None
    assert second.expires_in is not None
    assert 0 < second.expires_in <= 60
    # another key is free
    assert isinstance(leases_store.unique_claim("report:43", "task-2", 60), Claimed)


def test_a_republish_of_the_queued_task_id_is_its_own_claim(leases_store: LeaseStore):
    first = leases_store.unique_claim("k", "task-1", 1)
    again = leases_store.unique_claim("k", "task-1", 60)

    assert isinstance(first, Claimed)
    assert isinstance(again, Claimed)
    assert again.again
    assert again.token == first.token
    holder = leases_store.unique_holder("k")
    assert holder is not None
    assert holder.expires_in is not None
    assert holder.expires_in > 1  # raised to the longer TTL


def test_a_confirm_raises_a_pending_claims_ttl(leases_store: LeaseStore):
    claimed = leases_store.unique_claim("k", "task-1", 2)  # pending: the confirm window
    assert isinstance(claimed, Claimed)
    assert leases_store.unique_confirm("k", "task-1", claimed.token, 600)
    holder = leases_store.unique_holder("k")
    assert holder is not None
    assert holder.expires_in is not None
    assert holder.expires_in > 2
    # another task id or token confirms nothing
    assert not leases_store.unique_confirm("k", "task-2", claimed.token, 600)
    assert not leases_store.unique_confirm("k", "task-1", claimed.token + 1, 600)
    (listed,) = leases_store.queued_claims()
    assert listed.expires_in is not None
    assert listed.expires_in > 2


def test_a_task_taken_over_before_its_confirm_runs_and_is_not_brought_back(
    leases_store: LeaseStore,
):
    """A fast worker may start the task before its producer's confirm lands: the worker
    takes the pending claim over, and the late confirm neither touches the running claim
    nor, once the task ended, brings the claim back."""
    claimed = leases_store.unique_claim("k", "task-1", 2)
    assert isinstance(claimed, Claimed)
    held = leases_store.unique_handover("k", "task-1", A, 10)
    assert isinstance(held, Held)

    assert not leases_store.unique_confirm("k", "task-1", claimed.token, 600)
    holder = leases_store.unique_holder("k")
    assert holder is not None
    assert (holder.state, holder.task_id, holder.owner) == ("running", "task-1", A.owner)
    assert holder.expires_in is not None
    assert holder.expires_in <= 10

    assert leases_store.release([held]) == [True]
    assert not leases_store.unique_confirm("k", "task-1", claimed.token, 600)
    assert leases_store.unique_holder("k") is None
    assert leases_store.queued_claims() == []


def test_handover_is_checked_against_the_task_id(leases_store: LeaseStore):
    claimed = leases_store.unique_claim("k", "task-1", 60)
    assert isinstance(claimed, Claimed)

    stranger = leases_store.unique_handover("k", "task-2", A, 10)

    assert isinstance(stranger, ClaimHolder)
    assert (stranger.state, stranger.task_id) == ("queued", "task-1")
    holder = leases_store.unique_holder("k")
    assert holder is not None
    assert (holder.state, holder.task_id, holder.token) == ("queued", "task-1", claimed.token)

    held = leases_store.unique_handover("k", "task-1", A, 10)

    assert isinstance(held, Held)
    assert held.token > claimed.token
    assert (held.owner, held.task_id, held.mode) == (A.owner, "task-1", "x")
    running = leases_store.unique_holder("k")
    assert running is not None
    assert (running.state, running.task_id, running.owner) == ("running", "task-1", A.owner)
    # recorded in the owner's registry like any lease, with the task id
    (entry,) = leases_store.entries(A.owner)
    assert (entry.resource, entry.token, entry.task_id) == (held.resource, held.token, "task-1")
    # a producer now sees it running, with its task id
    refused = leases_store.unique_claim("k", "task-3", 60)
    assert isinstance(refused, ClaimHolder)
    assert (refused.state, refused.task_id, refused.owner) == ("running", "task-1", A.owner)
    # the same task id in another process is not handed the claim either
    twin = leases_store.unique_handover("k", "task-1", B, 10)
    assert isinstance(twin, ClaimHolder)
    assert twin.owner == A.owner

    assert leases_store.release([held]) == [True]
    assert leases_store.unique_holder("k") is None
    assert isinstance(leases_store.unique_claim("k", "task-3", 60), Claimed)


def test_a_key_without_a_claim_is_taken_fresh_by_the_worker(leases_store: LeaseStore):
    held = leases_store.unique_handover("free", "task-1", A, 10)
    assert isinstance(held, Held)
    assert leases_store.release([held]) == [True]


def test_requeue_keeps_the_claim_for_the_same_task(leases_store: LeaseStore):
    leases_store.unique_claim("k", "task-1", 60)
    held = leases_store.unique_handover("k", "task-1", A, 10)
    assert isinstance(held, Held)

    assert leases_store.unique_requeue(held, 60)

    holder = leases_store.unique_holder("k")
    assert holder is not None
    assert (holder.state, holder.task_id, holder.token) == ("queued", "task-1", held.token)
    assert leases_store.entries(A.owner) == []  # no longer the worker's lease
    # the old running lease cannot be released nor requeued again: token-checked
    assert leases_store.release([held]) == [False]
    assert not leases_store.unique_requeue(held, 60)
    assert leases_store.unique_holder("k") is not None
    # a duplicate is refused while the retry waits; the retry is handed the claim
    assert isinstance(leases_store.unique_claim("k", "task-2", 60), ClaimHolder)
    again = leases_store.unique_handover("k", "task-1", B, 10)
    assert isinstance(again, Held)
    leases_store.release([again])


def test_unclaim_only_frees_a_claim_still_queued_for_that_task(leases_store: LeaseStore):
    claimed = leases_store.unique_claim("k", "task-1", 60)
    assert isinstance(claimed, Claimed)

    assert not leases_store.unique_unclaim("k", "task-2")
    assert not leases_store.unique_unclaim("k", "task-1", claimed.token + 1)
    assert leases_store.unique_holder("k") is not None

    assert leases_store.unique_unclaim("k", "task-1", claimed.token)
    assert leases_store.unique_holder("k") is None
    assert not leases_store.unique_unclaim("k", "task-1")

    # a claim a worker took over is never unclaimed (it is released as a lease)
    leases_store.unique_claim("k", "task-3", 60)
    held = leases_store.unique_handover("k", "task-3", A, 10)
    assert isinstance(held, Held)
    assert not leases_store.unique_unclaim("k", "task-3")
    assert leases_store.release([held]) == [True]


def test_a_queued_claim_runs_out_with_its_ttl(leases_store: LeaseStore):
    leases_store.unique_claim("k", "task-1", 0.3)
    wait_until(lambda: leases_store.unique_holder("k") is None, 10, "the queued claim to expire")
    assert isinstance(leases_store.unique_claim("k", "task-2", 60), Claimed)


def test_the_cleanup_of_a_dead_owner_frees_a_running_claim(leases_store: LeaseStore):
    leases_store.unique_claim("k", "task-1", 60)
    held = leases_store.unique_handover("k", "task-1", A, 60)
    assert isinstance(held, Held)
    # the worker registered the owner under its node, as acquire does
    assert A.owner in leases_store.node_owners(A.node)

    report = leases_store.cleanup_node(A.node, keep_incarnation="another")

    assert report.released == [(A.owner, held.resource)]
    assert leases_store.unique_holder("k") is None


def test_queued_claims_are_listed_until_taken_over(leases_store: LeaseStore):
    leases_store.unique_claim("b", "task-b", 60)
    leases_store.unique_claim("a {x}", "task a", 60)

    listed = leases_store.queued_claims()

    assert [(c.key, c.task_id, c.state) for c in listed] == [
        ("a {x}", "task a", "queued"),
        ("b", "task-b", "queued"),
    ]
    held = leases_store.unique_handover("b", "task-b", A, 10)
    assert isinstance(held, Held)
    assert [c.key for c in leases_store.queued_claims()] == ["a {x}"]
    leases_store.release([held])


def test_a_redelivered_task_waits_for_its_first_run_and_is_woken_by_its_release(
    leases_store: LeaseStore, leases_redis: redis.Redis
):
    held = leases_store.unique_handover("k", "task-1", A, 30)
    assert isinstance(held, Held)
    channel = leases_store.resource_keys(held.resource).channel
    # another task id is answered without waiting: waiting cannot make it its own
    other = leases_store.unique_take("k", "task-2", B, 10, wait=30)
    assert isinstance(other, ClaimHolder)
    assert other.task_id == "task-1"
    released = threading.Event()

    def release_once_waited_for() -> None:
        wait_until(
            lambda: dict(leases_redis.pubsub_numsub(channel)).get(channel, 0) > 0,
            20,
            "the redelivered task to wait for the claim",
        )
        leases_store.release([held])
        released.set()

    thread = threading.Thread(target=release_once_waited_for)
    thread.start()
    try:
        taken = leases_store.unique_take("k", "task-1", B, 10, wait=25)
    finally:
        thread.join()
    assert released.is_set()
    assert isinstance(taken, Held)
    assert taken.owner == B.owner
    leases_store.release([taken])


def test_a_release_between_the_claim_read_and_the_registry_read_is_taken_not_given_up(
    leases_store: LeaseStore, monkeypatch: pytest.MonkeyPatch
):
    # the holder's task id is read from its registry after the handover script: a release
    # in between leaves no entry, and the taker must look again rather than give up
    held = leases_store.unique_handover("k", "task-1", A, 30)
    assert isinstance(held, Held)
    read_registry = _claims.registry_task
    releases: list[bool] = []

    def release_first(
        engine: LeaseEngine, owner: str, resource: str, token: int
    ) -> Steps[str | None]:
        if not releases:
            releases.extend(leases_store.release([held]))
        return (yield from read_registry(engine, owner, resource, token))

    monkeypatch.setattr(_claims, "registry_task", release_first)

    taken = leases_store.unique_take("k", "task-1", B, 10, wait=25)

    assert releases == [True]
    assert isinstance(taken, Held)
    assert taken.owner == B.owner
    leases_store.release([taken])


def test_claim_keys_share_one_hash_tag(make_leases_store, leases_redis: redis.Redis):
    store = make_leases_store(slot_groups=8)
    for i in range(20):
        key = f"key:{i}:{{x}}"
        store.unique_claim(key, f"task-{i}", 60)
        held = store.unique_handover(key, f"task-{i}", A, 10)
        assert isinstance(held, Held)
        assert store.unique_requeue(held, 60)
        resource = store.keys.unique_resource(key)
        rk = store.resource_keys(resource)
        keys = [
            rk.exclusive,
            rk.counter,
            store.keys.unique_queued(rk.group),
            store.keys.registry(A.owner, rk.group),
            store.keys.epoch(rk.group),
            store.keys.lifetime(rk.group),
        ]
        assert len({hash_tag(k) for k in keys}) == 1, keys
        assert store.unique_unclaim(key, f"task-{i}")
    tags = {hash_tag(k) for k in leases_redis.keys(f"{{{store.settings.key_prefix}:*")}
    assert len(tags) > 2  # the claims really were spread over the groups


def test_a_key_without_a_utf8_form_is_a_config_error(leases_store: LeaseStore):
    with pytest.raises(LeaseConfigError, match="UTF-8"):
        leases_store.unique_claim("a\ud800", "task-1", 60)
