"""The pipeline: each analysis's input is fetched once, then its steps run under leases.

- ``run_step(analysis_id, step)`` holds an exclusive lease on ``analysis:<id>:step:<step>`` (two
  copies of the same step never overlap, whichever worker or replica sent them) and a shared
  lease on the reference dataset with ``limit=3`` (at most three readers at once).
- Before working, every step calls ``leases.once("analysis:<id>:input", ...)``: the first caller
  downloads and unpacks the input, the others wait for its receipt.
- ``sweep_scratch`` runs from beat; two beat replicas run side by side and each run is sent once.

Each task also writes to a small ledger in Redis (``{<prefix>:demo}:*``) so the demo can prove
what happened: overlaps, concurrent readers, initialisations, beat runs.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import redis

from celery_leases import LeasedTask, Shared, current_leases
from celery_leases.signals import lease_busy

from .app import PREFIX, WORKDIR, app, leases

STEPS = ("align", "call", "annotate", "report")
DATASET_READERS = 3

_client: redis.Redis | None = None
_client_pid = -1


def ledger() -> redis.Redis:
    """A per-process Redis client for the demo's ledger."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(app.conf.broker_url, decode_responses=True)
        _client_pid = os.getpid()
    return _client


def key(*parts: object) -> str:
    return f"{{{PREFIX}:demo}}:" + ":".join(str(p) for p in parts)


def download_and_extract(analysis_id: int) -> dict[str, Any]:
    """Pretend to download and unpack an analysis's input (only one caller ever runs it)."""
    ledger().incr(key("inits", analysis_id))
    target = Path(WORKDIR) / f"analysis-{analysis_id}"
    staging = target.with_suffix(".partial")
    staging.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (staging / f"chunk-{i}.txt").write_text(f"analysis {analysis_id} chunk {i}\n")
        time.sleep(0.2)
    staging.replace(target) if not target.exists() else None
    return {"path": str(target), "files": 3}


@app.task(
    base=LeasedTask,
    bind=True,
    leases=[
        "analysis:{analysis_id}:step:{step}",
        Shared("dataset:reference", limit=DATASET_READERS),
    ],
    on_busy="retry",
    busy_timeout=120,
)
def run_step(self: Any, analysis_id: int, step: str) -> dict[str, Any]:
    """One step of one analysis."""
    r = ledger()
    step_lease, dataset_lease = current_leases()
    active = r.incr(key("active", analysis_id, step))
    readers = r.incr(key("readers"))
    try:
        if active > 1:
            r.incr(key("overlaps"))
        r.eval(
            "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then "
            "redis.call('SET', KEYS[1], ARGV[1]) end",
            1,
            key("max_readers"),
            readers,
        )
        receipt = leases.once(
            f"analysis:{analysis_id}:input",
            lambda: download_and_extract(analysis_id),
            ttl=10,
            wait=60,
        )
        time.sleep(random.uniform(0.2, 0.6))  # the actual work
        r.rpush(key("fences", analysis_id, step), step_lease.token)
        return {
            "analysis": analysis_id,
            "step": step,
            "input": receipt["path"],
            "token": step_lease.token,
            "dataset_token": dataset_lease.token,
            "worker": self.request.hostname,
        }
    finally:
        r.decr(key("readers"))
        r.decr(key("active", analysis_id, step))
        r.incr(key("done"))


@app.task(ignore_result=True)
def sweep_scratch() -> int:
    """Beat job: count a run (the demo checks each beat run was sent once)."""
    r = ledger()
    n = r.incr(key("beat_runs"))
    r.rpush(key("beat_times"), json.dumps(time.time()))
    return n


@lease_busy.connect
def count_busy(sender: object = None, task_id: str | None = None, **kwargs: Any) -> None:
    """Count busy leases met by tasks (the demo shows them as busy retries)."""
    if task_id is not None:
        ledger().incr(key("busy"))
