"""on_busy="defer": parked tasks, handed on by releases and the pump, with real workers."""

from __future__ import annotations

import json
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_leases import Leases, _parking
from celery_leases._identity import Identity
from celery_leases._lease import Want
from celery_leases._parking import list_parked, unpark
from tests.support.polling import wait_until
from tests.support.workers import WorkerProc, leases_cli

from . import park_app
from .conftest import APP

DEADLINE = 300.0


def events(client: redis.Redis, prefix: str) -> list[tuple[str, str, int, str, int, int]]:
    out = []
    for raw in client.lrange(park_app.ledger_key(prefix), 0, -1):
        e, tenant, n, task_id, parked, us = raw.decode().split(" ")
        out.append((e, tenant, int(n), task_id, int(parked), int(us)))
    return out


def most_at_once(evs: list[tuple[str, str, int, str, int, int]]) -> dict[str, int]:
    """Per tenant, the most bodies that ran at once (by the Redis clock)."""
    points: dict[str, list[tuple[int, int]]] = defaultdict(list)
    open_: dict[str, tuple[str, int]] = {}
    for e, tenant, _, task_id, _, us in evs:
        if e == "s":
            open_[task_id] = (tenant, us)  # a start never ended (its worker killed) is dropped
        elif task_id in open_:
            tenant, start = open_.pop(task_id)
            points[tenant] += [(start, 1), (us, -1)]
    most: dict[str, int] = {}
    for tenant, pts in points.items():
        now = top = 0
        for _, d in sorted(pts, key=lambda p: (p[0], p[1])):  # an end before a start at a tie
            now += d
            top = max(top, now)
        most[tenant] = top
    return most


def run_tenants(
    producer: Celery,
    leases_redis: redis.Redis,
    leases_prefix: str,
    kill: Callable[[], None] | None = None,
) -> tuple[list[tuple[str, str, int, str, int, int]], int]:
    """The ledger's events, and the Redis time (us) once the lone task C was sent."""
    client = redis.Redis.from_url(producer.conf.broker_url)
    erp = producer.tasks["park_app.erp"]
    for tenant in "AB":  # tenant by tenant: the first 4 tasks of A fill the slots
        for n in range(200):
            erp.delay(tenant, n)
    erp.delay("C", 0)
    s, us = client.time()
    lone_sent = s * 1_000_000 + us
    if kill is not None:
        wait_until(
            lambda: sum(1 for e in events(client, leases_prefix) if e[0] == "e") >= 150,
            DEADLINE,
            "150 bodies done",
        )
        kill()

    def done() -> bool:
        ends = {(e[1], e[2]) for e in events(client, leases_prefix) if e[0] == "e"}
        return len(ends) == 401

    wait_until(done, DEADLINE, "all 401 tasks done")
    evs = events(client, leases_prefix)
    client.close()
    return evs, lone_sent


def hand_ons_before_the_lone_task(
    evs: list[tuple[str, str, int, str, int, int]], lone_sent: int
) -> tuple[int, int, int]:
    """How many hand-ons the lone task C waited for: copies of the other tenants published
    before C was sent that started after it was sent and before C started (ahead of C in the
    broker's queue). Also: all the copies that started before C (most were handed on before C
    existed), and those published after C was sent that still started first (two deliveries
    dispatched at once to two pool processes: whichever writes its start first)."""
    (c_start,) = [e[5] for e in evs if e[0] == "s" and e[1] == "C"]
    published = {(e[3], e[4]): e[5] for e in evs if e[0] == "p"}
    copies = [(published.get((e[3], e[4])), e[5]) for e in evs if e[0] == "s" and e[4] > 0]
    before = [(pub, start) for pub, start in copies if start < c_start]
    waited = sum(1 for pub, start in before if pub is not None and pub < lone_sent < start)
    later = sum(1 for pub, _ in before if pub is not None and pub > lone_sent)
    return waited, len(before), later


def check_tenants(evs: list[tuple[str, str, int, str, int, int]], *, exactly_once: bool) -> None:
    starts = Counter((e[1], e[2]) for e in evs if e[0] == "s")
    assert set(starts) == {("A", n) for n in range(200)} | {("B", n) for n in range(200)} | {
        ("C", 0)
    }
    if exactly_once:
        assert max(starts.values()) == 1, [k for k, v in starts.items() if v > 1][:5]
    most = most_at_once(evs)
    assert most["A"] <= 2, most
    assert most["B"] <= 2, most
    # deferral happened: most of A's and B's tasks ran from a hand-on's copy
    copies = sum(1 for e in evs if e[0] == "s" and e[4] > 0)
    assert copies > 100
    # the lone tenant is not held back by the others' parked queues: its task is never parked
    (c_start,) = [e for e in evs if e[0] == "s" and e[1] == "C"]
    assert c_start[4] == 0


def test_tenants_limit_two_each_done_once(
    producer: Celery,
    leases_redis: redis.Redis,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
):
    start_worker(concurrency=4)
    evs, lone_sent = run_tenants(producer, leases_redis, leases_prefix)
    check_tenants(evs, exactly_once=True)
    # the lone task starts within 2 hand-ons: C, never parked, waits only for what is ahead of
    # it in the broker's queue, where each tenant has at most `limit` (2) copies at a time (a
    # copy holds one of its tenant's places); B's first tasks start after C was sent
    waited, before, later = hand_ons_before_the_lone_task(evs, lone_sent)
    print(f"the lone task waited for {waited} hand-on(s); {before} copies started before it, "
          f"{later} of them published after it was sent")  # fmt: skip
    assert waited <= 2
    # and within a tenant, first parked first served: after the first 2 tasks of A and of B,
    # every task ran from a hand-on (a newcomer parks behind the parked ones, even in the
    # moment between a release and its hand-on)
    originals = Counter(e[1] for e in evs if e[0] == "s" and e[4] == 0)
    print(f"tasks that started without being parked: {dict(originals)}")
    assert originals["A"] == 2
    assert originals["B"] == 2
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    wait_until(lambda: not list_parked(ext), 30, "no parked task left")


def test_tenants_with_worker_killed_halfway(
    producer: Celery,
    leases_redis: redis.Redis,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
):
    worker = start_worker(concurrency=4)

    def kill() -> None:
        worker.kill9()
        worker.start()

    evs, _ = run_tenants(producer, leases_redis, leases_prefix, kill)
    # acks_late: a body cut by the kill runs again (at least once); every task is done
    check_tenants(evs, exactly_once=False)
    starts = Counter((e[1], e[2]) for e in evs if e[0] == "s")
    # at most the bodies running at the kill (4 slots) started twice
    assert sum(v - 1 for v in starts.values()) <= 4


def celery_leases(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return leases_cli(APP, env, *args)


def test_unpark_cancels_and_marks_revoked(
    producer: Celery,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    worker_env: dict[str, str],
):
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    excl = producer.tasks["park_app.excl"]
    with ext.hold("excl:T"):
        start_worker(concurrency=2)
        result = excl.delay("T", 1)
        wait_until(lambda: list_parked(ext, "excl:T"), 30, "the task parked")
        listed = celery_leases(worker_env, "parked", "excl:T", "--json")
        assert listed.returncode == 0, listed.stderr
        shown = json.loads(listed.stdout)
        assert shown["count"] == 1
        (entry,) = shown["parked"]
        assert entry["task_id"] == result.id
        assert entry["state"] == "parked"
        done = celery_leases(worker_env, "unpark", result.id, "--yes")
        assert done.returncode == 0, done.stderr
        assert not unpark(ext, result.id)  # a second time: not parked
        again = celery_leases(worker_env, "unpark", result.id, "--yes")
        assert again.returncode == 1
        assert "not parked" in again.stderr
    wait_until(lambda: result.state == "REVOKED", 30, "the unparked task REVOKED")


def run_exclusive(
    producer: Celery, leases_prefix: str, tenant: str, count: int
) -> list[tuple[str, str, int, str, int, int]]:
    client = redis.Redis.from_url(producer.conf.broker_url)
    excl = producer.tasks["park_app.excl"]
    for n in range(count):
        excl.delay(tenant, n)

    def done() -> bool:
        ends = {e[2] for e in events(client, leases_prefix) if e[0] == "e" and e[1] == tenant}
        return len(ends) == count

    wait_until(done, DEADLINE, f"all {count} tasks of {tenant} done")
    evs = events(client, leases_prefix)
    client.close()
    starts = Counter(e[2] for e in evs if e[0] == "s")
    assert starts == Counter(range(count))  # every task ran, once
    assert most_at_once(evs)[tenant] == 1
    assert sum(1 for e in evs if e[0] == "s" and e[4] > 0) > 0  # some ran from a hand-on
    return evs


def test_hazard5_redelivery_guard_runs_every_handed_on_copy(
    producer: Celery, leases_prefix: str, start_worker: Callable[..., WorkerProc]
):
    # without the guard's parked generation, the parked delivery's completion record (or the
    # early ack's) would make the guard drop the copy the hand-on published: never done
    start_worker(concurrency=3, env={"CELERY_LEASES_REDELIVERY_GUARD": "true"})
    run_exclusive(producer, leases_prefix, "G", 20)


def test_hazard3_releaser_killed_between_hand_on_and_publish(
    producer: Celery,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    tmp_path: Path,
):
    trap = tmp_path / "die-before-publish"
    trap.write_text("1")
    worker = start_worker(concurrency=2, env={"CELERY_LEASES_TEST_DIE_BEFORE_PUBLISH": str(trap)})
    run_exclusive(producer, leases_prefix, "K", 10)
    assert not trap.exists()  # a releaser did die there
    assert "killed between a hand-on and its publish" in worker.log()


def test_hazard6_a_parked_unique_task_keeps_its_claim(
    producer: Celery,
    leases_redis: redis.Redis,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
):
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    uniq = producer.tasks["park_app.uniq"]
    client = redis.Redis.from_url(producer.conf.broker_url)
    with ext.hold("excl:U"):
        start_worker(concurrency=2)
        first = uniq.delay("U", 1)
        wait_until(lambda: list_parked(ext, "excl:U"), 30, "the task parked")
        # parked, it is still queued: a second send is a duplicate of it
        again = uniq.delay("U", 2)
        assert again.id == first.id
    # the release hands it on: the copy is the claim's holder and runs, once
    wait_until(lambda: [e for e in events(client, leases_prefix) if e[0] == "e"], 30, "it ran")
    wait_until(lambda: not list_parked(ext), 30, "nothing parked")
    starts = [e for e in events(client, leases_prefix) if e[0] == "s"]
    assert [(e[2], e[3], e[4]) for e in starts] == [(1, first.id, 1)]
    # and its claim was released at its end: the key takes a new task
    third = uniq.delay("U", 3)
    assert third.id != first.id
    wait_until(
        lambda: len([e for e in events(client, leases_prefix) if e[0] == "e"]) == 2, 30, "3 ran"
    )
    client.close()


def test_a_releaser_killed_before_its_publish_is_taken_over_by_its_cleanup(
    producer: Celery,
    leases_prefix: str,
    queue: str,
    start_worker: Callable[..., WorkerProc],
    tmp_path: Path,
):
    # the releaser (the pool process that ran task 0) is killed between its hand-on to task 1
    # and the publish; its worker's reaper cleans its owner and publishes task 1 at once. The
    # hand-on's reservation lasts 300 s: running out is not what saves the task here
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    trap = tmp_path / "die-before-publish"
    trap.write_text("1")
    env = {
        "CELERY_LEASES_TEST_DIE_BEFORE_PUBLISH": str(trap),
        "CELERY_LEASES_HANDON_TIMEOUT": "300",
        "PAPP_SLOW": "2",
    }
    worker = start_worker(concurrency=2, env=env)
    client = redis.Redis.from_url(producer.conf.broker_url)
    excl = producer.tasks["park_app.excl"]

    def started(n: int) -> list[tuple[str, str, int, str, int, int]]:
        return [e for e in events(client, leases_prefix) if e[0] == "s" and e[2] == n]

    try:
        excl.delay("R", 0)
        wait_until(lambda: started(0), 60, "task 0 started")
        second = excl.delay("R", 1)
        wait_until(lambda: list_parked(ext, "excl:R"), 60, "task 1 parked")
        wait_until(lambda: not trap.exists(), 60, "the releaser of excl:R killed")
        wait_until(lambda: started(1), 120, "task 1 started")
        (end0,) = [e for e in events(client, leases_prefix) if e[0] == "e" and e[2] == 0]
        (start1,) = started(1)
        delay = (start1[5] - end0[5]) / 1e6
        print(f"task 1 started {delay:.2f} s after task 0's body ended (handon_timeout 300 s)")
        assert delay < 60
        assert start1[3] == second.id
        assert start1[4] == 1  # the published copy of its parked delivery
        # nothing left to run it again: nothing parked, no copy queued, and it ran once
        wait_until(lambda: [e for e in events(client, leases_prefix) if e[:3] == ("e", "R", 1)],
                   60, "task 1 done")  # fmt: skip
        wait_until(lambda: not list_parked(ext) and not client.llen(queue), 60, "nothing left")
        assert len(started(1)) == 1
        log = worker.log()
        assert "killed between a hand-on and its publish" in log
        assert f"took over the hand-on to {second.id}" in log
    finally:
        client.close()


@pytest.mark.parametrize("on", ["lease", "limit"])
def test_a_pump_killed_before_its_publish_is_taken_over_at_its_restart(
    producer: Celery,
    leases_prefix: str,
    start_worker: Callable[..., WorkerProc],
    tmp_path: Path,
    on: str,
):
    # the hand-on is the pump's, in the worker's main process, which holds no lease: it is
    # killed between the hand-on and the publish; its node's start-up cleanup, when the worker
    # comes back, takes the hand-on over (the reservation, or a limit's hand-on in flight,
    # lasts 300 s: not what saves it)
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    trap = tmp_path / "die-before-publish"
    trap.write_text("1")
    env = {
        "CELERY_LEASES_TEST_DIE_BEFORE_PUBLISH": str(trap),
        "CELERY_LEASES_HANDON_TIMEOUT": "300",
    }
    worker = start_worker(concurrency=2, env=env)
    client = redis.Redis.from_url(producer.conf.broker_url)
    try:
        if on == "lease":
            # a holder that dies without a release: its lease runs out, only the pump hands on
            me = ext.identity()
            ghost = Identity(f"ghost-{leases_prefix}", me.incarnation, me.pid)
            ext.store.acquire([Want("excl:M", "x", 0)], ghost, 2.0)
            parked = producer.tasks["park_app.excl"].delay("M", 1)
            wait_until(lambda: list_parked(ext, "excl:M"), 60, "the task parked")
        else:
            for _ in range(5):  # the window of rl:M full: the task is refused and parks
                ext.limit("rl:M", "5/s")
            parked = producer.tasks["park_app.rated"].delay("M", 1)
        wait_until(lambda: not worker.alive(), 60, "the pump's process killed at its hand-on")
        assert not trap.exists()
        [entry] = list_parked(ext, "excl:M" if on == "lease" else "rl:M")
        assert (entry["task_id"], entry["on"], entry["state"]) == (parked.id, on, "handed on")
        worker.start()
        wait_until(lambda: [e for e in events(client, leases_prefix) if e[:2] == ("e", "M")],
                   60, "the parked task done")  # fmt: skip
        starts = [e for e in events(client, leases_prefix) if e[0] == "s"]
        assert [(e[3], e[4]) for e in starts] == [(parked.id, 1)]
        assert f"took over the hand-on to {parked.id}" in worker.current_log()
        wait_until(lambda: not list_parked(ext), 60, "nothing parked")
    finally:
        client.close()


def test_a_task_that_parks_again_frees_the_reservation_of_its_other_lease(
    producer: Celery,
    leases_redis_url: str,
    leases_prefix: str,
    queue: str,
    start_worker: Callable[..., WorkerProc],
):
    # T (leases pa:Z and pb:Z) parks on pa:Z, W (pa:Z only) behind it; pa:Z is handed on to
    # T (reserved for T for 300 s); T's copy finds pb:Z busy and parks there: W must start
    # at once, not when T's reservation on pa:Z runs out (handon_timeout, 300 s)
    ext: Leases = producer.leases  # type: ignore[attr-defined]
    client = redis.Redis.from_url(producer.conf.broker_url)
    me = ext.identity()
    ghost = Identity(f"ghost-{leases_prefix}", me.incarnation, me.pid)
    try:
        start_worker(concurrency=2, env={"CELERY_LEASES_HANDON_TIMEOUT": "300"})
        [held_a] = ext.store.acquire([Want("pa:Z", "x", 0)], ghost, 600.0)
        [held_b] = ext.store.acquire([Want("pb:Z", "x", 0)], ghost, 600.0)
        first = producer.tasks["park_app.pair"].delay("Z", 1)
        wait_until(lambda: list_parked(ext, "pa:Z"), 60, "T parked on pa:Z")
        waiter = producer.tasks["park_app.pa"].delay("Z", 2)
        wait_until(lambda: len(list_parked(ext, "pa:Z")) == 2, 60, "W parked behind T")
        ext.store.release([held_a])
        # the releaser's hand-on to T reserves pa:Z for 300 s (its handon_timeout)
        releaser = park_app.make_app(
            broker=leases_redis_url, queue=queue, handon_timeout=300,
            redis_url=leases_redis_url, key_prefix=leases_prefix,
        )  # fmt: skip
        other: Leases = releaser.leases  # type: ignore[attr-defined]
        try:
            assert _parking.hand_on_released(other, ["pa:Z"]) == 1
        finally:
            other.store.close()
            releaser.close()
        wait_until(lambda: list_parked(ext, "pb:Z"), 60, "T parked again, on pb:Z")
        wait_until(lambda: [e for e in events(client, leases_prefix) if e[:3] == ("e", "Z", 2)],
                   60, "W ran, without waiting for T's reservation to run out")  # fmt: skip
        ext.store.release([held_b])
        assert _parking.hand_on_released(ext, ["pb:Z"]) == 1  # to T
        wait_until(lambda: [e for e in events(client, leases_prefix) if e[:3] == ("e", "Z", 1)],
                   60, "T ran")  # fmt: skip
        starts = [(e[3], e[4]) for e in events(client, leases_prefix) if e[0] == "s"]
        assert starts == [(waiter.id, 1), (first.id, 2)]  # each once, from its hand-on
        wait_until(lambda: not list_parked(ext), 60, "nothing parked")
    finally:
        client.close()
