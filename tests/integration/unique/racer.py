"""Many threads sending one unique task at once; run as a process by the concurrency test.

``python -m tests.integration.unique.racer URL PREFIX QUEUE KEY THREADS START_KEY [TASK]``:
makes a ``unique_app`` producer, counts itself ready at ``START_KEY:ready``, waits until
``START_KEY`` is set, then sends from ``THREADS`` threads at once and prints their outcomes as a
JSON list. ``TASK`` (default ``unique_app.raising``) other than that one is sent with a ``tag``
naming the process and thread (``<pid>-<n>``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from celery import Celery

from celery_leases import DuplicateTask
from tests.integration.unique import unique_app


def race(
    app: Celery, key: str, go: Callable[[], object], n: int, task: str = "unique_app.raising"
) -> list[str]:
    """``n`` threads wait for ``go``, then each sends ``task(key)`` once (with a ``tag``
    unless it is ``unique_app.raising``).

    Returns each thread's outcome: ``"sent <id>"`` (``"sent <id> <tag>"`` when tagged),
    ``"duplicate <holder id>"`` or ``"error <repr>"``.
    """
    out: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        go()
        tag = "" if task == "unique_app.raising" else f"{os.getpid()}-{i}"
        try:
            result = app.tasks[task].delay(key, *((tag,) if tag else ()))
            outcome = f"sent {result.id} {tag}".rstrip()
        except DuplicateTask as exc:
            outcome = f"duplicate {exc.task_id}"
        except Exception as exc:  # reported, and failed on, by the test
            outcome = f"error {exc!r}"
        with lock:
            out.append(outcome)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


#: the repository's root, the racing processes' working directory and import path
REPO = Path(__file__).resolve().parents[3]


def race_producers(
    producer: Celery,
    url: str,
    prefix: str,
    queue: str,
    key: str,
    *,
    processes: int,
    threads: int,
    local_threads: int,
    task: str = "unique_app.raising",
) -> list[str]:
    """``processes`` racing processes of ``threads`` threads each, and ``local_threads``
    threads of this process (``producer``), send ``task(key)`` at once; the outcome of every
    send (see :func:`race`), all of them asserted free of errors."""
    from tests.support.polling import wait_until

    start_key = f"{{{prefix}:ledger}}:start:{task}:{key}"
    client = redis.Redis.from_url(url)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "tests.integration.unique.racer", url, prefix, queue, key]
    racers = [
        subprocess.Popen(
            [*argv, str(threads), start_key, task],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        wait_until(
            lambda: int(client.get(start_key + ":ready") or 0) >= processes,
            60,
            "the racing processes to be ready",
        )
        barrier = threading.Event()
        local: list[str] = []
        runner = threading.Thread(
            target=lambda: local.extend(race(producer, key, barrier.wait, local_threads, task))
        )
        runner.start()
        client.set(start_key, "1", ex=600)  # every process and thread goes now
        barrier.set()
        runner.join(120)
        remote: list[str] = []
        for proc in racers:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr
            remote.extend(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in racers:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        client.close()
    outcomes = local + remote
    assert len(outcomes) == processes * threads + local_threads
    assert not [o for o in outcomes if o.startswith("error")], outcomes
    return outcomes


def main(argv: list[str]) -> None:
    url, prefix, queue, key, n, start_key, *task = argv
    app = unique_app.make_app(broker=url, queue=queue, redis_url=url, key_prefix=prefix)
    client = redis.Redis.from_url(url)
    client.incr(start_key + ":ready")

    def go() -> None:
        while not client.get(start_key):
            time.sleep(0.001)

    print(json.dumps(race(app, key, go, int(n), *task)))


if __name__ == "__main__":
    main(sys.argv[1:])
