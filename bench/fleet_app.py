"""The Celery app that ``bench/fleet.py`` runs in its worker processes.

Configured from the environment (set by the benchmark): ``BENCH_FLEET_BROKER``,
``BENCH_FLEET_LEDGER`` (a Redis URL; never the lease Redis, so the lease Redis counts lease
traffic only), ``BENCH_FLEET_QUEUE`` (an idle queue the workers start on), ``BENCH_FLEET_BODY``
(seconds each task body sleeps), plus every ``CELERY_LEASES_*`` setting.

Both tasks take ``(rid, run, seq)``, sleep the body time and push one record to the ledger
list ``bench-fleet:<run>:done``: ``"<seq> <latency us> <busy retries> <end unix us>"``.
``leased`` holds an exclusive lease on ``fleet:<rid>`` (``on_busy="retry"``); its latency is
the time from its first acquire attempt to the grant: the acquire call itself when the lease
was free at once, else from the first busy reply (the ``lease_busy_since`` header the retries
carry) to the grant, busy-retry countdowns and the queueing of the retried message included.
``plain`` records latency 0.
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

import redis
from celery import Celery, Task

from celery_leases import LeasedTask, Leases
from celery_leases.signals import lease_acquired
from celery_leases.task import BUSY_ATTEMPT_HEADER, BUSY_SINCE_HEADER

BROKER: Final = os.environ.get("BENCH_FLEET_BROKER", "redis://127.0.0.1:6379/15")
LEDGER: Final = os.environ.get("BENCH_FLEET_LEDGER", BROKER)
QUEUE: Final = os.environ.get("BENCH_FLEET_QUEUE", "bench-fleet-idle")
BODY: Final = float(os.environ.get("BENCH_FLEET_BODY", "0.005"))

app = Celery("bench_fleet", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
)
if BROKER.startswith(("redis://", "rediss://")):
    # a Redis broker's idle BRPOP returns every 50 ms instead of every second, so a queue
    # added by remote control (each round's) is consumed within 50 ms, not up to 1 s later
    app.conf.broker_transport_options = {"polling_interval": 0.05}
leases = Leases(app)

_ledger: tuple[int, redis.Redis] | None = None


def ledger() -> redis.Redis:
    """This process's ledger client (made again after a fork)."""
    global _ledger
    if _ledger is None or _ledger[0] != os.getpid():
        _ledger = (os.getpid(), redis.Redis.from_url(LEDGER, decode_responses=True))
    return _ledger[1]


#: task id -> (unix time of the grant, seconds the granting acquire call took); filled by the
#: lease_acquired signal, which is sent in the process that runs the task, just before the body
_grants: dict[str, tuple[float, float]] = {}


def done_key(run: str) -> str:
    """The ledger list the tasks of run ``run`` push their records to."""
    return f"bench-fleet:{run}:done"


def on_lease_acquired(task_id: str | None = None, elapsed: float = 0.0, **_: Any) -> None:
    if task_id is not None:
        _grants[task_id] = (time.time(), elapsed)


lease_acquired.connect(on_lease_acquired, weak=False, dispatch_uid="bench.fleet_app")


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _record(run: str, seq: int, latency: float, retries: int) -> None:
    end_us = int(time.time() * 1e6)
    ledger().rpush(done_key(run), f"{seq} {int(latency * 1e6)} {retries} {end_us}")


@app.task(base=LeasedTask, bind=True, lease="fleet:{rid}", on_busy="retry")
def leased(self: Task[Any, Any], rid: int, run: str, seq: int) -> None:
    """Sleep the body time under an exclusive lease on ``fleet:<rid>``, then record."""
    request = self.request
    granted_at, elapsed = _grants.pop(str(request.id), (time.time(), 0.0))
    since = _header(request, BUSY_SINCE_HEADER)
    latency = granted_at - float(since) if since is not None else elapsed
    retries = int(_header(request, BUSY_ATTEMPT_HEADER) or 0)
    if BODY:
        time.sleep(BODY)
    _record(run, seq, latency, retries)


@app.task
def plain(rid: int, run: str, seq: int) -> None:
    """The same body and record without a lease (the baseline)."""
    if BODY:
        time.sleep(BODY)
    _record(run, seq, 0.0, 0)
