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
import sys
import threading
import time
from collections.abc import Callable

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
