"""Mutual exclusion on one resource under threads and processes, proved by a ledger in Redis."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time

import redis

from celery_leases import Leases

THREADS = 8
PROCESSES = 4
ROUNDS = 12


def ledger_keys(prefix: str) -> tuple[str, str, str]:
    # under the test's prefix, so the session's cleanup deletes them
    base = f"{{{prefix}}}:ledger"
    return f"{base}:inside", f"{base}:seen", f"{base}:grants"


def work_under_lease(client: redis.Redis, prefix: str, token: int, who: str) -> None:
    """The ledger: how many are inside now (must be 1), and the grant order with its token."""
    inside, seen, grants = ledger_keys(prefix)
    now_inside = client.incr(inside)
    client.rpush(seen, now_inside)
    client.rpush(grants, f"{token} {who}")
    client.get(inside)  # a round trip inside: room for an overlap if exclusion broke
    client.decr(inside)


def check_ledger(client: redis.Redis, prefix: str, expected: int) -> list[str]:
    inside, seen, grants = ledger_keys(prefix)
    concurrency = [int(x) for x in client.lrange(seen, 0, -1)]
    assert len(concurrency) == expected
    assert max(concurrency) == 1, "two holders were inside at once"
    assert int(client.get(inside) or 0) == 0
    rows = [str(x).split(" ", 1) for x in client.lrange(grants, 0, -1)]
    tokens = [int(t) for t, _ in rows]
    assert all(a < b for a, b in itertools.pairwise(tokens)), "tokens must grow in grant order"
    return [who for _, who in rows]


def switches(order: list[str]) -> int:
    return sum(1 for a, b in itertools.pairwise(order) if a != b)


def test_threads_exclude_each_other(leases: Leases, leases_redis, leases_prefix):
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        client = redis.Redis.from_url(leases.settings.url, decode_responses=True)
        try:
            start.wait(timeout=30)
            for _ in range(ROUNDS):
                with leases.hold("the-resource", ttl=5, wait=30) as lease:
                    work_under_lease(client, leases_prefix, lease.token, f"t{n}")
                time.sleep(0.001)  # pacing outside the lease, so the threads interleave
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    order = check_ledger(leases_redis, leases_prefix, THREADS * ROUNDS)
    assert set(order) == {f"t{n}" for n in range(THREADS)}
    assert switches(order) >= THREADS, "the threads never contended"


CHILD = textwrap.dedent(
    """
    import os, sys, time
    import redis
    from celery import Celery
    from celery_leases import Leases
    from tests.integration.test_exclusion import ROUNDS, ledger_keys, work_under_lease

    url, prefix = sys.argv[1], sys.argv[2]
    leases = Leases(Celery("child", set_as_current=False), redis_url=url, key_prefix=prefix)
    client = redis.Redis.from_url(url, decode_responses=True)
    go = ledger_keys(prefix)[0] + ":go"
    client.incr(ledger_keys(prefix)[0] + ":ready")
    assert client.blpop([go], timeout=60), "never told to start"
    for _ in range(ROUNDS):
        with leases.hold("the-resource", ttl=5, wait=60) as lease:
            work_under_lease(client, prefix, lease.token, f"p{os.getpid()}")
        time.sleep(0.002)
    client.close()
    leases.store.close()
    print("done")
    """
)


def test_processes_exclude_each_other(leases: Leases, leases_redis, leases_prefix):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, leases.settings.url, leases_prefix],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    inside = ledger_keys(leases_prefix)[0]
    try:
        deadline = time.monotonic() + 60
        while int(leases_redis.get(inside + ":ready") or 0) < PROCESSES:
            assert time.monotonic() < deadline, "the child processes did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        leases_redis.rpush(inside + ":go", *["go"] * PROCESSES)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "done"

    order = check_ledger(leases_redis, leases_prefix, PROCESSES * ROUNDS)
    assert set(order) == {f"p{p.pid}" for p in procs}
    assert switches(order) >= PROCESSES, "the processes never contended"
