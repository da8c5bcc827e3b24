"""The Celery app that the beat integration tests run in real ``celery beat`` processes.

Configured from the environment: ``LEASES_BEAT_BROKER`` (the test Redis), ``LEASES_BEAT_QUEUE``
(where this test's runs are sent), ``LEASES_BEAT_REPLICA`` (a label for this replica),
``LEASES_BEAT_SKEW`` (seconds this replica's clock is off, for ``SkewedScheduler``),
``LEASES_BEAT_ENTRIES`` (``every``, ``cron`` or both, comma-separated), plus every
``CELERY_LEASES_*`` setting (key prefix, TTL, beat mode). For redbeat's scheduler,
``LEASES_BEAT_REDBEAT_PREFIX`` (its key prefix, on the broker Redis) and
``LEASES_BEAT_REDBEAT_LOCK`` (``on`` keeps redbeat's lock, off by default). The entries of
the policy tests: ``catchup`` (every ``LEASES_BEAT_CATCHUP_EVERY`` seconds, default 10, with
``leases_catchup_window`` from ``LEASES_BEAT_WINDOW`` when it is set) and ``overlap`` (a run
of ``LEASES_BEAT_RUN_FOR`` seconds, default 3, every ``LEASES_BEAT_OVERLAP_EVERY`` seconds,
default 1, with ``leases_overlap`` from ``LEASES_BEAT_OVERLAP``, default ``skip``).

No worker consumes the queue (but in the overlap tests): a test counts the messages in the
Redis list named after it.
Each message is stamped, in the sending beat process just before it is published, with the
replica that sent it, the send time on the Redis clock and the entry's claim as Redis holds it
at that moment (``x_replica``, ``x_pid``, ``x_sent_ms``, ``x_claim`` headers).
"""

from __future__ import annotations

import os
import time
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
CATCHUP_ENTRY = "catchup"
CATCHUP_TASK = "beat_app.catchup"
CATCHUP_EVERY = float(os.environ.get("LEASES_BEAT_CATCHUP_EVERY", "10"))
OVERLAP_ENTRY = "overlap"
OVERLAP_TASK = "beat_app.slow"
OVERLAP_EVERY = float(os.environ.get("LEASES_BEAT_OVERLAP_EVERY", "1"))
RUN_FOR = float(os.environ.get("LEASES_BEAT_RUN_FOR", "3"))
#: the Redis list where each run of ``slow`` records "<start ms> <end ms> <task id>"
RUNS_KEY = f"{QUEUE}:runs"
#: task name -> (beat entry, kind of its claim key)
ENTRY_OF = {
    EVERY_TASK: (EVERY_ENTRY, "every"),
    CRON_TASK: (CRON_ENTRY, "cron"),
    CATCHUP_TASK: (CATCHUP_ENTRY, "every"),
    OVERLAP_TASK: (OVERLAP_ENTRY, "every"),
}

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
if "catchup" in ENTRIES:
    _window = os.environ.get("LEASES_BEAT_WINDOW")
    _schedule[CATCHUP_ENTRY] = {
        "task": CATCHUP_TASK,
        "schedule": timedelta(seconds=CATCHUP_EVERY),
        "options": {} if _window is None else {"leases_catchup_window": float(_window)},
    }
if "overlap" in ENTRIES:
    _schedule[OVERLAP_ENTRY] = {
        "task": OVERLAP_TASK,
        "schedule": timedelta(seconds=OVERLAP_EVERY),
        "options": {"leases_overlap": os.environ.get("LEASES_BEAT_OVERLAP", "skip")},
    }
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


@app.task(name=CATCHUP_TASK)
def catchup() -> None:
    """Never runs: no worker consumes the test queue."""


@app.task(name=OVERLAP_TASK)
def slow() -> None:
    """Run ``RUN_FOR`` seconds; record the start and end on the Redis clock."""
    client = redis.Redis.from_url(BROKER, decode_responses=True)
    seconds, micros = client.time()
    start = seconds * 1000 + micros // 1000
    time.sleep(RUN_FOR)
    seconds, micros = client.time()
    client.rpush(RUNS_KEY, f"{start} {seconds * 1000 + micros // 1000} {slow.request.id}")
    client.close()


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
