"""The Celery app of the redelivery-guard tests, run in real ``celery worker`` processes.

Configured from the environment: ``GUARD_BROKER`` (the Redis test server or RabbitMQ),
``GUARD_QUEUE``, ``GUARD_KEYPREFIX`` (kombu's ``global_keyprefix`` on Redis, so the test's
``unacked`` keys are its own), ``GUARD_VISIBILITY`` (seconds), ``GUARD_LEDGER``, plus every
``CELERY_LEASES_*`` setting (``CELERY_LEASES_REDELIVERY_GUARD`` turns the guard on). kombu's
restore sweep runs every second (``unacked_restore_interval=1``,
``unacked_restore_throttle=1``). ``GUARD_NO_KEEPALIVE=1`` turns the guard's keep-alive off, so
that copies are delivered while the first one runs.

The tasks are plain ``@app.task`` tasks (no lease of their own) with ``acks_late``; each run
is counted in a ledger in Redis (``{<prefix>:ledger}:...``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery import Celery, signals

from celery_leases import Leases
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("GUARD_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("GUARD_QUEUE", "guard-tests")
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "guard-tests")
LEDGER_URL = os.environ.get("GUARD_LEDGER", "redis://127.0.0.1:6379/15")

app = Celery("guard_app", broker=BROKER)
options: dict[str, Any] = {}
if BROKER.startswith("redis"):
    options = {
        "visibility_timeout": float(os.environ.get("GUARD_VISIBILITY", "3")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "global_keyprefix": os.environ.get("GUARD_KEYPREFIX", "guard-tests:"),
    }
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_transport_options=options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
)
leases = Leases(app)

if os.environ.get("GUARD_NO_KEEPALIVE"):
    # the broker restores the deliveries of this live worker, as without the keep-alive: the
    # copies meet the guard lease instead
    from celery_leases._guard import KeepAlive

    KeepAlive.touch = lambda self: None  # type: ignore[method-assign]

ledger = PerProcessClient(LEDGER_URL)


def ledger_key(*parts: object) -> str:
    return f"{{{PREFIX}:ledger}}:" + ":".join(str(p) for p in parts)


def _note(event: str, task_id: str) -> int:
    """Record ``event`` of ``task_id``; how many times it was recorded, this one included."""
    r = ledger()
    pipe = r.pipeline(transaction=False)
    pipe.incr(ledger_key(event, task_id))
    pipe.rpush(ledger_key("events"), f"{event} {task_id} {os.getpid()} {time.time():.3f}")
    return int(pipe.execute()[0])


@app.task(bind=True, acks_late=True)
def slow(self: Any, seconds: float = 8.0, first: float | None = None) -> str:
    """A plain acks_late task: counts its start and its end in the ledger. Its first run
    sleeps ``first`` seconds when given (one a test kills: it must outlast the start of
    another worker, which a loaded machine can make longer than ``seconds``)."""
    started = _note("started", self.request.id)
    time.sleep(first if first is not None and started == 1 else seconds)
    _note("finished", self.request.id)
    return "done"


@app.task(bind=True, acks_late=True, max_retries=1)
def retry_once(self: Any) -> str:
    """Retries itself once: the retry has the same task id and must not be dropped."""
    _note("started", self.request.id)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    _note("finished", self.request.id)
    return "done"


@app.task(bind=True, acks_late=True)
def lose_ack(self: Any) -> str:
    """Finishes, then its worker is killed (below) before the main process acks it."""
    _note("started", self.request.id)
    _note("finished", self.request.id)
    return "done"


@signals.task_postrun.connect
def _kill_before_ack(sender: Any = None, **kwargs: Any) -> None:
    # connected after Leases(app): the guard's completion record is written first
    if getattr(sender, "name", None) != lose_ack.name:
        return
    _note("killing", kwargs.get("task_id") or "?")
    parent = os.getppid()
    if parent > 1:
        os.kill(parent, signal.SIGKILL)  # the worker's main process: the ack is never sent
    os.kill(os.getpid(), signal.SIGKILL)
