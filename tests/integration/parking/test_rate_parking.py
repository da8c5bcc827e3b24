"""on_busy="defer" on a rate limit: tasks refused by the limit wait in Redis, in the limit's
FIFO, and are handed on when its window has room again, with real workers.

Every admission is stamped with the Redis time the limit script admitted it at (the ledger's
``"a"`` lines, written by the workers' ``limit_admitted`` handler), so "at most N in any
window" is checked on the clock the limit promises it on; each body's start is stamped on
the Redis clock too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery

from bench.limits import most_in_any_window
from celery_leases import Leases
from celery_leases._parking import list_parked
from tests.support.polling import wait_until
from tests.support.workers import WorkerProc, amqp_url_or_skip

from . import park_app
from .test_parking import DEADLINE, celery_leases, events

US = 1_000_000
COUNT = 40
S_COUNT = 10  # tenant S: its own limit key, of the same template
RATE_N = 5  # park_app.rated: Rate("rl:{tenant}", "5/s")

Events = list[tuple[str, str, int, str, int, int]]


def run_rated(
    producer: Celery,
    leases_prefix: str,
    worker_env: dict[str, str],
    kill: Callable[[], None] | None = None,
) -> tuple[Events, dict[str, object]]:
    """40 rated tasks of tenant R sent at once; when many are parked, a plain task and a
    rated task of tenant S (its own limit); the operator's listing while they wait."""
    client = redis.Redis.from_url(producer.conf.result_backend)  # the ledger's Redis
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    rated = producer.tasks["park_app.rated"]
    for n in range(COUNT):
        rated.delay("R", n)

    # the backlog drains at 5 a second at most: with 25 parked, seconds are left to look
    wait_until(lambda: len(list_parked(ext, "rl:R")) >= 25, DEADLINE, "25 tasks parked")
    producer.tasks["park_app.plain"].delay("P", 0)
    for n in range(S_COUNT):
        rated.delay("S", n)
    listed = celery_leases(worker_env, "parked", "rl:R", "--json")
    assert listed.returncode == 0, listed.stderr
    shown = json.loads(listed.stdout)
    if kill is not None:
        wait_until(
            lambda: sum(1 for e in events(client, leases_prefix) if e[0] == "e") >= 15,
            DEADLINE,
            "15 bodies done",
        )
        kill()

    def done() -> bool:
        ends = {(e[1], e[2]) for e in events(client, leases_prefix) if e[0] == "e"}
        return len(ends) == COUNT + 1 + S_COUNT

    wait_until(done, DEADLINE, f"all {COUNT + 1 + S_COUNT} tasks done")
    evs = events(client, leases_prefix)
    client.close()
    wait_until(lambda: not list_parked(ext), 30, "no parked task left")
    return evs, shown


def check_rated(evs: Events, shown: dict[str, object], *, exactly_once: bool) -> None:
    starts = Counter((e[1], e[2]) for e in evs if e[0] == "s")
    assert set(starts) == {("R", n) for n in range(COUNT)} | {("P", 0)} | {
        ("S", n) for n in range(S_COUNT)
    }
    if exactly_once:
        assert max(starts.values()) == 1, [k for k, v in starts.items() if v > 1][:5]

    # the limit, exactly: at most 5 admissions in any 1-second window of the Redis clock
    admitted = sorted(e[5] for e in evs if e[0] == "a" and e[1] == "rl:R")
    most = most_in_any_window([(at, 1) for at in admitted], US)
    assert most <= RATE_N, most
    # every admission was a body that ran: a copy refused all the same parked again
    assert len(admitted) == sum(starts[("R", n)] for n in range(COUNT))
    r_starts = sorted(e[5] for e in evs if e[0] == "s" and e[1] == "R")
    used = (len(admitted) - 1) / max(1e-6, (admitted[-1] - admitted[0]) / US)
    print(
        f"rated: {len(admitted)} admissions, most in any 1 s window {most} (limit {RATE_N}); "
        f"body starts: most in any 1 s window "
        f"{most_in_any_window([(s, 1) for s in r_starts], US)}; "
        f"{used:.2f} admissions/s under the backlog"
    )
    # the backlog waited parked, not in the broker or a slot: most ran from a hand-on's copy
    copies = sum(1 for e in evs if e[0] == "s" and e[1] == "R" and e[4] > 0)
    assert copies >= 25, copies

    # no slot blocked: a plain task, and 10 tasks of another key of the same limit template
    # (5 admitted at once, the others parked in their own FIFO), sent with 25 or more of R
    # parked, all ran before R's backlog was through: one key does not hold another back
    last_r = r_starts[-1]
    others = [e for e in evs if e[0] == "s" and e[1] in ("P", "S")]
    assert max(e[5] for e in others) < last_r
    assert any(e[4] > 0 for e in others if e[1] == "S")  # S's parked ones too
    s_admitted = sorted(e[5] for e in evs if e[0] == "a" and e[1] == "rl:S")
    assert most_in_any_window([(at, 1) for at in s_admitted], US) <= RATE_N

    # the operator's listing: the parked ones, on the rate limit
    parked = shown["parked"]
    assert isinstance(parked, list)
    assert shown["count"] == len(parked) > 0
    assert {p["resource"] for p in parked} == {"rl:R"}
    assert {p["on"] for p in parked} == {"limit"}
    assert {p["task"] for p in parked} == {"park_app.rated"}


def test_rate_parked_tasks_keep_the_limit_and_run_once(
    producer: Celery,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    worker_env: dict[str, str],
):
    start_worker(concurrency=4)
    evs, shown = run_rated(producer, leases_prefix, worker_env)
    check_rated(evs, shown, exactly_once=True)


def test_rate_parked_tasks_with_the_worker_killed_halfway(
    producer: Celery,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    worker_env: dict[str, str],
):
    worker = start_worker(concurrency=4)

    def kill() -> None:
        worker.kill9()
        worker.start()

    evs, shown = run_rated(producer, leases_prefix, worker_env, kill)
    # acks_late: a body cut by the kill runs again (at least once); every task is done
    check_rated(evs, shown, exactly_once=False)
    starts = Counter((e[1], e[2]) for e in evs if e[0] == "s")
    assert sum(v - 1 for v in starts.values()) <= 4  # at most the bodies running at the kill


@pytest.fixture
def amqp_producer(leases_redis_url: str, leases_prefix: str, queue: str) -> Iterator[Celery]:
    """The producer over RabbitMQ (leases, ledger and results in Redis); its queue deleted
    after."""
    app = park_app.make_app(
        broker=amqp_url_or_skip(),
        queue=queue,
        backend=leases_redis_url,
        redis_url=leases_redis_url,
        key_prefix=leases_prefix,
    )
    yield app
    app.leases.store.close()  # type: ignore[attr-defined]
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue)
    app.close()
    client = redis.Redis.from_url(leases_redis_url)
    try:
        client.delete(park_app.ledger_key(leases_prefix))
    finally:
        client.close()


def test_rate_parked_tasks_over_rabbitmq(
    amqp_producer: Celery,
    leases_redis_url: str,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    worker_env: dict[str, str],
):
    env = {"LEASES_TEST_BROKER": amqp_producer.conf.broker_url}
    env["LEASES_TEST_BACKEND"] = leases_redis_url
    worker = start_worker(concurrency=4, env=env)
    assert "amqp://" in worker.log()
    # hand-ons publish to RabbitMQ through the worker's producer: the same guarantees
    evs, shown = run_rated(amqp_producer, leases_prefix, {**worker_env, **env})
    check_rated(evs, shown, exactly_once=True)


def test_a_newcomer_under_a_limit_queues_behind_the_parked_task(
    producer: Celery, leases_prefix: str, start_worker: Callable[..., WorkerProc]
) -> None:
    # P is parked on one:Q (1/s); no worker runs while the window gets room again; newcomer
    # N is sent then, and a worker starts: whether N's delivery comes before the pump's
    # hand-on of P (P still parked) or after it (P's hand-on in flight holds the room), N
    # parks behind P and starts after it. Before the fix N was admitted at once and ran first
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    client = redis.Redis.from_url(producer.conf.broker_url)
    task = producer.tasks["park_app.rated_one"]
    try:
        worker = start_worker(concurrency=1)
        ext.limit("one:Q", "1/s")  # the window's one admission
        first = task.delay("Q", 1)
        wait_until(lambda: list_parked(ext, "one:Q"), 60, "P parked")
        worker.stop()
        assert [p["state"] for p in list_parked(ext, "one:Q")] == ["parked"]
        wait_until(lambda: not client.zcard(ext.store.keys.limit_keys("one:Q")[0]), 30,
                   "the window has room")  # fmt: skip
        newcomer = task.delay("Q", 2)
        worker.start()
        wait_until(
            lambda: sum(1 for e in events(client, leases_prefix) if e[0] == "e") == 2,
            DEADLINE,
            "both ran",
        )
        starts = [e for e in events(client, leases_prefix) if e[0] == "s"]
        assert [e[3] for e in starts] == [first.id, newcomer.id]
        assert [e[4] for e in starts] == [1, 1]  # both ran from a hand-on: N was parked too
    finally:
        client.close()
