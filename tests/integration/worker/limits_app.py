"""The Celery app of the rate limit fleet test (tests/integration/worker/test_limits_fleet.py).

Configured from the environment like ``worker_app`` (``LEASES_TEST_BROKER``,
``LEASES_TEST_QUEUE``, ``LEASES_TEST_LEDGER``, ``CELERY_LEASES_*``). Each task stamps its
start with the Redis clock (``TIME``) and counts its run by task id in the ledger.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

from celery_leases import LeasedTask, Leases, Rate, signals
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "leases-tests")
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "leases-tests")
LEDGER_URL = os.environ.get("LEASES_TEST_LEDGER", BROKER)

app = Celery("limits_app", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
leases = Leases(app)
ledger = PerProcessClient(LEDGER_URL)


#: the Redis time (us) of this process's last admission, from the limit_admitted signal
_admitted: dict[str, int] = {}


@signals.limit_admitted.connect(weak=False)
def _on_admitted(sender: Any = None, **kwargs: Any) -> None:
    _admitted["at"] = round(kwargs["at"] * 1_000_000)


@worker_process_init.connect(weak=False)
def _connect_ledger(**kwargs: Any) -> None:
    # connected before the first task, so no start stamp waits for a new connection
    ledger().ping()


def ledger_key(*parts: object) -> str:
    return f"{{{PREFIX}:ledger}}:" + ":".join(str(p) for p in parts)


def _stamp(kind: str, task_id: str) -> None:
    r = ledger()
    sec, usec = r.time()
    pipe = r.pipeline(transaction=False)
    start = sec * 1_000_000 + usec
    pipe.rpush(ledger_key("starts", kind), f"{start} {task_id} {_admitted.get('at', 0)}")
    pipe.hincrby(ledger_key("runs"), task_id, 1)
    pipe.execute()


@app.task(
    bind=True, base=LeasedTask, rate=Rate("A:{key}", "10/s"), on_busy="retry", busy_timeout=900
)
def call_a(self: LeasedTask, key: str) -> None:
    _stamp("A", str(self.request.id))


@app.task(
    bind=True, base=LeasedTask, rate=Rate("B:{key}", "100/m"), on_busy="retry", busy_timeout=900
)
def call_b(self: LeasedTask, key: str) -> None:
    _stamp("B", str(self.request.id))
