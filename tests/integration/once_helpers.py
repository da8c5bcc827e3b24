"""What ``test_once.py`` runs in processes of their own.

- ``python -m tests.integration.once_helpers NAME ROLE [--ttl S] [--wait S] [--sleep S]
  [--block] [--fail] [--barrier]``: one caller of ``leases.once(NAME, fn)``; prints one JSON
  line with what it got (``receipt``, whether ``fn`` ran here, or the ``error``).
- a Celery app (``-A tests.integration.once_helpers``) whose task ``once_helpers.needs_init``
  calls ``leases.once`` in its body, for real workers.

Configured from the environment: the ``CELERY_LEASES_*`` settings (the test's Redis and key
prefix), ``ONCE_TEST_BROKER`` and ``ONCE_TEST_QUEUE``. What an initializer does is recorded in a
ledger under ``{<prefix>:ledger}:`` keys, through a client of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_leases import Leases
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("ONCE_TEST_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("ONCE_TEST_QUEUE", "leases-once-tests")
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "leases-once-tests")
LEDGER_URL = os.environ.get("CELERY_LEASES_REDIS_URL", BROKER)

app = Celery("once_helpers", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
)
leases = Leases(app)

#: a per-process client for the ledger (never the store under test)
ledger = PerProcessClient(LEDGER_URL)


def ledger_key(prefix: str, *parts: object) -> str:
    return f"{{{prefix}:ledger}}:" + ":".join(str(p) for p in parts)


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def initializer(
    name: str, role: str, *, sleep: float = 0.0, block: bool = False, fail: bool = False
) -> Callable[[], dict[str, Any]]:
    """An initializer for ``once(name, ...)`` that leaves a trace in the ledger.

    It counts its runs (``runs:<name>``), records when it started and ended (``ran:<name>``,
    ``done:<name>``, Redis clock) and returns a value that is different on every run; a tuple in
    it comes back from the JSON round trip as a list. ``block`` waits until the test pushes to
    ``release:<name>`` (or kills the process); ``fail`` raises ``ValueError`` at the end.
    """

    def fn() -> dict[str, Any]:
        r = ledger()
        r.incr(ledger_key(PREFIX, "runs", name))
        r.rpush(
            ledger_key(PREFIX, "ran", name),
            json.dumps({"role": role, "pid": os.getpid(), "at_ms": redis_ms(r)}),
        )
        if block:  # until the test pushes to "release:<name>" (or kills this process)
            r.blpop([ledger_key(PREFIX, "release", name)], timeout=120)
        if sleep:
            time.sleep(sleep)  # the initialisation's work
        r.rpush(ledger_key(PREFIX, "done", name), json.dumps({"role": role, "at_ms": redis_ms(r)}))
        if fail:
            raise ValueError(f"{role} fails on purpose")
        return {"role": role, "pid": os.getpid(), "nonce": uuid.uuid4().hex, "pair": (1, 2)}

    return fn


@app.task(name="once_helpers.needs_init", bind=True)
def needs_init(self: Any, name: str, i: int, sleep: float = 1.0) -> None:
    """A task that needs ``name`` initialised once; records what it got in the ledger."""
    ran: list[bool] = []
    fn = initializer(name, f"task-{i}", sleep=sleep)

    def init() -> dict[str, Any]:
        ran.append(True)
        return fn()

    value = leases.once(name, init, wait=30)
    ledger().rpush(
        ledger_key(PREFIX, "task-results", name),
        json.dumps(
            {"i": i, "pid": os.getpid(), "node": self.request.hostname, "ran": bool(ran)}
            | {"receipt": value}
        ),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="once_helpers")
    parser.add_argument("name")
    parser.add_argument("role")
    parser.add_argument("--ttl", type=float, default=None)
    parser.add_argument("--wait", type=float, default=30.0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--block", action="store_true")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--barrier", action="store_true", help="wait for the test's go")
    args = parser.parse_args(argv)

    r = ledger()
    fn = initializer(args.name, args.role, sleep=args.sleep, block=args.block, fail=args.fail)
    ran: list[bool] = []

    def init() -> dict[str, Any]:
        ran.append(True)
        return fn()

    if args.barrier:
        r.rpush(ledger_key(PREFIX, "ready", args.name), args.role)
        if r.blpop([ledger_key(PREFIX, "go", args.name)], timeout=30) is None:
            print(json.dumps({"role": args.role, "error": "no go"}), flush=True)
            return 1
    out: dict[str, Any] = {"role": args.role, "pid": os.getpid(), "called_ms": redis_ms(r)}
    r.rpush(ledger_key(PREFIX, "calling", args.name), args.role)
    try:
        value = leases.once(args.name, init, ttl=args.ttl, wait=args.wait)
    except Exception as exc:  # reported to the test
        out |= {"error": type(exc).__name__, "message": str(exc), "ran": bool(ran)}
    else:
        pair = value.get("pair") if isinstance(value, dict) else None
        out |= {"receipt": value, "ran": bool(ran), "pair_type": type(pair).__name__}
    finally:
        leases.store.close()
        r.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
