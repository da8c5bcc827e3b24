"""Enqueue-time uniqueness on the producer side, with a real broker (no worker consumes).

Every path that publishes goes through the claim: ``apply_async``/``delay``, ``send_task`` by
name, signatures, groups and chains. A duplicate gets the task's ``on_duplicate`` policy, a
failed publish gives its claim back, and many producers racing for one key send exactly one
message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery, group, signature
from celery.result import AsyncResult, EagerResult
from kombu.exceptions import OperationalError

from celery_leases import DuplicateTask, LeaseBusy, LeaseConfigError, Leases
from celery_leases._claims import ClaimHolder
from celery_leases._lease import MAX_NAME_BYTES
from celery_leases.signals import unique_duplicate

from .conftest import QUEUE_TTL, wait_until
from .racer import race_producers

pytestmark = pytest.mark.worker

REPO = Path(__file__).resolve().parents[3]


def queued_ids(client: redis.Redis, queue: str) -> list[str]:
    """Task ids of the messages waiting in ``queue`` (oldest first)."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange(queue, 0, -1))]


def test_a_duplicate_gets_the_existing_result_by_default(
    producer: Celery, leases_redis: redis.Redis, queue: str
):
    gated = producer.tasks["unique_app.gated"]

    first = gated.delay("k1")
    second = gated.delay("k1")
    third = gated.apply_async(("k1",), task_id="explicit-id")

    assert isinstance(second, AsyncResult)
    assert second.id == first.id
    assert third.id == first.id
    assert queued_ids(leases_redis, queue) == [first.id]
    # another key is another claim
    other = gated.delay("k2")
    assert other.id != first.id
    assert queued_ids(leases_redis, queue) == [first.id, other.id]


def test_raise_and_ignore_policies(producer: Celery, leases_redis: redis.Redis, queue: str):
    seen: list[dict[str, object]] = []

    def receiver(sender: object = None, **kwargs: object) -> None:
        seen.append({"sender": sender, **kwargs})

    unique_duplicate.connect(receiver, weak=False)
    try:
        first = producer.tasks["unique_app.raising"].delay("k")
        with pytest.raises(DuplicateTask) as info:
            producer.tasks["unique_app.raising"].delay("k")
    finally:
        unique_duplicate.disconnect(receiver)
    assert (info.value.key, info.value.task_id, info.value.state) == ("job:k", first.id, "queued")
    (signal,) = seen
    assert signal["sender"] == "unique_app.raising"
    assert (signal["key"], signal["holder_task_id"], signal["state"], signal["policy"]) == (
        "job:k",
        first.id,
        "queued",
        "raise",
    )
    assert signal["task_id"] != first.id
    assert isinstance(info.value, LeaseBusy)
    assert "job:k" in str(info.value)
    assert first.id in str(info.value)

    ignored = producer.tasks["unique_app.ignoring"].delay("k")  # same template: same key
    assert isinstance(ignored, EagerResult)
    assert ignored.state == "REJECTED"
    assert ignored.id != first.id
    assert ignored.get() is None
    # per call, on_duplicate wins over the task's
    per_call = producer.tasks["unique_app.raising"].apply_async(("k",), on_duplicate="existing")
    assert per_call.id == first.id
    assert queued_ids(leases_redis, queue) == [first.id]


def test_an_unknown_policy_is_a_config_error(producer: Celery):
    with pytest.raises(ValueError, match="on_duplicate='sometimes'"):
        producer.tasks["unique_app.quick"].apply_async(("k",), on_duplicate="sometimes")


def test_send_task_by_name_signatures_groups_and_chains_are_refused_too(
    producer: Celery, leases_redis: redis.Redis, queue: str
):
    first = producer.send_task("unique_app.raising", ("k",))
    assert queued_ids(leases_redis, queue) == [first.id]

    with pytest.raises(DuplicateTask):
        producer.send_task("unique_app.raising", kwargs={"key": "k"})
    with pytest.raises(DuplicateTask):
        signature("unique_app.raising", args=("k",), app=producer).delay()
    with pytest.raises(DuplicateTask):
        producer.tasks["unique_app.raising"].s("k").apply_async()
    with pytest.raises(DuplicateTask):
        group(producer.tasks["unique_app.raising"].s(k) for k in ("k", "k-other")).apply_async()
    with pytest.raises(DuplicateTask):
        (
            producer.tasks["unique_app.raising"].si("k")
            | producer.tasks["unique_app.quick"].si("x")
        ).delay()
    assert queued_ids(leases_redis, queue) == [first.id]


def test_the_worker_gets_the_claimed_key_in_a_header(
    producer: Celery, leases_redis: redis.Redis, queue: str
):
    result = producer.tasks["unique_app.quick"].delay("k:{x} y")

    (raw,) = leases_redis.lrange(queue, 0, -1)
    headers = json.loads(raw)["headers"]
    assert headers["id"] == result.id
    assert headers["lease_unique"] == "job:k:{x} y"


def test_a_failed_publish_gives_its_claim_back(
    make_producer: Callable[..., Celery], leases_redis: redis.Redis, queue: str
):
    # a broker nobody listens on: the publish fails after the claim was taken
    with socket_nobody_listens_on() as dead_port:
        dead = make_producer(broker=f"redis://127.0.0.1:{dead_port}/0")
        dead.conf.broker_connection_retry = False
        dead.conf.broker_connection_max_retries = 0
        ext: Leases = dead.leases  # type: ignore[attr-defined]

        with pytest.raises(OperationalError):
            dead.tasks["unique_app.raising"].apply_async(("k",), retry=False)

    assert ext.store.unique_holder("job:k") is None
    live = make_producer()
    sent = live.tasks["unique_app.raising"].delay("k")
    assert queued_ids(leases_redis, queue) == [sent.id]


class socket_nobody_listens_on:
    """A loopback port that was free a moment ago (connections to it are refused)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_countdown_lengthens_the_queue_ttl(producer: Celery, leases_of: Leases):
    producer.tasks["unique_app.quick"].apply_async(("later",), countdown=1000)
    producer.tasks["unique_app.quick"].apply_async(("now",))

    later = leases_of.store.unique_holder("job:later")
    now = leases_of.store.unique_holder("job:now")
    assert later is not None
    assert now is not None
    assert later.expires_in is not None
    assert now.expires_in is not None
    assert QUEUE_TTL + 900 < later.expires_in <= QUEUE_TTL + 1000
    assert now.expires_in <= QUEUE_TTL


def test_a_claim_runs_out_with_the_queue_ttl(
    make_producer: Callable[..., Celery], leases_redis: redis.Redis, queue: str
):
    app = make_producer(unique_ttl=0.5)
    ext: Leases = app.leases  # type: ignore[attr-defined]
    first = app.tasks["unique_app.raising"].delay("k")
    # a message lost in the broker (or a producer that died after claiming) blocks the key
    # for the queue TTL only
    leases_redis.delete(queue)
    wait_until(lambda: ext.store.unique_holder("job:k") is None, 10, "the claim to run out")
    second = app.tasks["unique_app.raising"].delay("k")
    assert second.id != first.id
    assert queued_ids(leases_redis, queue) == [second.id]


# --- many producers at once -------------------------------------------------------------------
THREADS = 50
PROCESSES = 4
THREADS_PER_PROCESS = 10


def test_concurrent_producers_send_exactly_one(
    producer: Celery, leases_redis_url: str, leases_prefix: str, queue: str, leases_redis
):
    key = "contended"
    outcomes = race_producers(
        producer, leases_redis_url, leases_prefix, queue, key,
        processes=PROCESSES, threads=THREADS_PER_PROCESS, local_threads=THREADS,
    )  # fmt: skip
    sent = [o.split()[1] for o in outcomes if o.startswith("sent")]
    assert len(sent) == 1, sent
    (winner,) = sent
    assert all(o == f"duplicate {winner}" for o in outcomes if not o.startswith("sent"))
    assert queued_ids(leases_redis, queue) == [winner]
    holder = producer.leases.store.unique_holder(f"job:{key}")  # type: ignore[attr-defined]
    assert isinstance(holder, ClaimHolder)
    assert holder.task_id == winner


def test_a_unique_key_too_long_is_refused_before_the_claim_and_the_publish(
    producer: Celery, leases_redis: redis.Redis, queue: str, leases_prefix: str
):
    # the rendered key is bounded alone (celery_leases:unique: before it is not counted)
    gated = producer.tasks["unique_app.gated"]
    with pytest.raises(LeaseConfigError) as info:
        gated.delay("k" * MAX_NAME_BYTES)
    text = str(info.value)
    assert "unique template 'job:{key}' renders to a name that is 1,028 bytes" in text
    assert f"at most {MAX_NAME_BYTES:,} bytes" in text
    assert queued_ids(leases_redis, queue) == []  # nothing published
    assert list(leases_redis.scan_iter(match=f"{{{leases_prefix}:*", count=1000)) == []
    fits = gated.delay("k" * (MAX_NAME_BYTES - len("job:")))
    assert queued_ids(leases_redis, queue) == [fits.id]
