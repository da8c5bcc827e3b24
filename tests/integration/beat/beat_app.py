"""The Celery app that the beat integration tests run in real ``celery beat`` processes.

Configured from the environment: ``LEASES_BEAT_BROKER`` (the test Redis), ``LEASES_BEAT_QUEUE``
(where this test's runs are sent), ``LEASES_BEAT_REPLICA`` (a label for this replica),
``LEASES_BEAT_SKEW`` (seconds this replica's clock is off, for ``SkewedScheduler``),
``LEASES_BEAT_ENTRIES`` (``every``, ``cron`` or both, comma-separated), plus every
``CELERY_LEASES_*`` setting (key prefix, TTL, beat mode). For redbeat's scheduler,
``LEASES_BEAT_REDBEAT_PREFIX`` (its key prefix, on the broker Redis) and
``LEASES_BEAT_REDBEAT_LOCK`` (``on`` keeps redbeat's lock, off by default).

No worker consumes the queue: a test counts the messages in the Redis list named after it.
Each message is stamped, in the sending beat process just before it is published, with the
replica that sent it, the send time on the Redis clock and the entry's claim as Redis holds it
at that moment (``x_replica``, ``x_pid``, ``x_sent_ms``, ``x_claim`` headers).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

import redis
from celery import Celery
from celery.schedules import crontab
from celery.signals import before_task_publish

from celery_leases import Leases
from celery_leases.beat import LeasedScheduler

BROKER = os.environ.get("LEASES_BEAT_BROKER", "redis://127.0.0.1:6379/15")
QUEUE = os.environ.get("LEASES_BEAT_QUEUE", "leases-beat-tests")
REPLICA = os.environ.get("LEASES_BEAT_REPLICA", "?")
SKEW = timedelta(seconds=float(os.environ.get("LEASES_BEAT_SKEW", "0")))
ENTRIES = os.environ.get("LEASES_BEAT_ENTRIES", "every,cron").split(",")

#: the interval of the ``every-1s`` entry, in seconds
INTERVAL = 1.0
EVERY_ENTRY = "every-1s"
CRON_ENTRY = "cron-every-minute"
EVERY_TASK = "beat_app.every"
CRON_TASK = "beat_app.cron"
#: task name -> (beat entry, kind of its claim key)
ENTRY_OF = {EVERY_TASK: (EVERY_ENTRY, "every"), CRON_TASK: (CRON_ENTRY, "cron")}

app = Celery("beat_app", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=None,  # no celery.backend_cleanup entry
    timezone="UTC",
)
_schedule: dict[str, Any] = {}
if "every" in ENTRIES:
    _schedule[EVERY_ENTRY] = {"task": EVERY_TASK, "schedule": timedelta(seconds=INTERVAL)}
if "cron" in ENTRIES:
    _schedule[CRON_ENTRY] = {"task": CRON_TASK, "schedule": crontab()}
app.conf.beat_schedule = _schedule
if "LEASES_BEAT_REDBEAT_PREFIX" in os.environ:  # the redbeat replicas (see ``composed``)
    app.conf.update(
        redbeat_redis_url=BROKER,
        redbeat_key_prefix=os.environ["LEASES_BEAT_REDBEAT_PREFIX"],
    )
    if os.environ.get("LEASES_BEAT_REDBEAT_LOCK") != "on":
        app.conf.redbeat_lock_key = None  # as docs/beat.md says: the claims dedupe
leases = Leases(app)


@app.task(name=EVERY_TASK)
def every() -> None:
    """Never runs: no worker consumes the test queue."""


@app.task(name=CRON_TASK)
def cron() -> None:
    """Never runs: no worker consumes the test queue."""


_stamp_client: redis.Redis | None = None


@before_task_publish.connect
def _stamp(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp the message with who sent it, when (Redis clock), and the claim Redis holds."""
    global _stamp_client
    if headers is None or sender not in ENTRY_OF:
        return
    if _stamp_client is None:
        _stamp_client = redis.Redis.from_url(BROKER, decode_responses=True)
    entry, kind = ENTRY_OF[sender]
    claim_key = leases.store.keys.beat_claim(entry, kind)
    if leases.settings.url == BROKER:  # one server: read both at one instant
        pipe = _stamp_client.pipeline(transaction=True)
        pipe.time()
        pipe.get(claim_key)
        (seconds, micros), claim = pipe.execute()
    else:  # leases on a Cluster or behind Sentinel: the claim lives there
        seconds, micros = _stamp_client.time()
        claim = leases.store.client.get(claim_key)
    headers["x_replica"] = REPLICA
    headers["x_pid"] = os.getpid()
    headers["x_sent_ms"] = seconds * 1000 + micros // 1000
    headers["x_claim"] = claim


_real_now = app.now


def skewed_now() -> datetime:
    """This replica's idea of now: the app's real clock plus ``LEASES_BEAT_SKEW``."""
    return _real_now() + SKEW


class SkewedScheduler(LeasedScheduler):
    """A ``LeasedScheduler`` whose clock is off by ``LEASES_BEAT_SKEW`` seconds.

    Beat decides what is due, and when to wake up, from ``entry.default_now()``: the entry's
    ``schedule.now()``, which is ``app.now()`` for schedules without their own ``nowfun`` (all
    of ours, and every entry unpickled from the schedule file, since a crontab does not pickle
    its ``nowfun``). So the app's clock is skewed, before any entry is made.
    """

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        app.now = skewed_now  # type: ignore[method-assign]
        super().__init__(app, *args, **kwargs)
