"""The Celery app of the revocation tests (tests/integration/worker/test_revoke.py).

Configured from the environment like ``worker_app`` (``LEASES_TEST_BROKER``,
``LEASES_TEST_QUEUE``, ``LEASES_TEST_LEDGER``, ``CELERY_LEASES_*``). Each task records, in
the ledger, its lease's token when it starts and the Redis clock (us) when it learns of its
revocation, so a test measures how soon a holder learns on the one clock of Redis.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_leases import FencedRedis, LeasedTask, LeaseRevoked, Leases, current_leases
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "leases-tests")
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "leases-tests")
LEDGER_URL = os.environ.get("LEASES_TEST_LEDGER", BROKER)

app = Celery("revoke_app", broker=BROKER, backend=os.environ.get("LEASES_TEST_BACKEND", BROKER))
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=600,
    worker_prefetch_multiplier=1,
)
leases = Leases(app)
ledger = PerProcessClient(LEDGER_URL)


def ledger_key(*parts: object) -> str:
    return f"{{{PREFIX}:ledger}}:" + ":".join(str(p) for p in parts)


def fenced_store() -> FencedRedis:
    """The fenced store both holders write the report to (on the ledger's Redis)."""
    return FencedRedis(redis.Redis.from_url(LEDGER_URL), prefix=f"{PREFIX}:fenced")


def redis_us() -> int:
    sec, usec = ledger().time()
    return int(sec) * 1_000_000 + int(usec)


def _record(name: str, value: Any) -> None:
    ledger().rpush(ledger_key("events", name), str(value))


@app.task(base=LeasedTask, lease="rv:{rid}")
def obeys(rid: str, seconds: float = 60.0) -> str:
    """Works until LeaseRevoked is raised in the body (on_lost="interrupt"), then stops."""
    (lease,) = current_leases()
    _record(f"started:{rid}", lease.token)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(0.01)
    except LeaseRevoked as exc:
        _record(f"revoked:{rid}", f"{redis_us()} {exc.deadline} {exc.reason}")
        return "revoked"
    return "not revoked"


@app.task(base=LeasedTask, lease="rv:{rid}", on_lost="log")
def stubborn(rid: str, seconds: float) -> bool:
    """Ignores its revocation (on_lost="log"): checks its lease every 10 ms, records when
    check() first raised LeaseRevoked, works on for ``seconds`` in all, then writes the
    report fenced with its token (late: after the deadline). Returns whether it was applied."""
    (lease,) = current_leases()
    _record(f"started:{rid}", lease.token)
    learned = False
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            lease.check()
        except LeaseRevoked as exc:
            if not learned:
                learned = True
                _record(f"revoked:{rid}", f"{redis_us()} {exc.deadline} {exc.reason}")
        time.sleep(0.01)
    applied = fenced_store().set(f"report:{rid}", f"stubborn {lease.token}", fence=lease)
    _record(f"wrote:{rid}", applied)
    return applied
