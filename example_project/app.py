"""The example project's Celery app: an analysis pipeline guarded by leases.

Configured from the environment so the demo can run it against any Redis:
``REDIS_URL`` (broker, results and leases), ``DEMO_PREFIX`` (key prefix of this run),
``DEMO_QUEUE`` and ``DEMO_WORKDIR`` (where inputs are "downloaded").
"""

from __future__ import annotations

import os
from datetime import timedelta

from celery import Celery

from celery_leases import Leases

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
PREFIX = os.environ.get("DEMO_PREFIX", "demo")
QUEUE = os.environ.get("DEMO_QUEUE", "demo")
WORKDIR = os.environ.get("DEMO_WORKDIR", "/tmp/celery-leases-demo")

app = Celery(
    "example_project", broker=REDIS_URL, backend=REDIS_URL, include=["example_project.tasks"]
)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    worker_prefetch_multiplier=1,
    beat_scheduler="celery_leases.beat:LeasedScheduler",
    beat_schedule={
        "sweep-scratch": {
            "task": "example_project.tasks.sweep_scratch",
            "schedule": timedelta(seconds=2),
        },
    },
    # celery_leases settings (also settable as CELERY_LEASES_* in the environment)
    leases_key_prefix=PREFIX,
    leases_ttl=6.0,
    leases_retry_delay=0.3,
    leases_retry_max_delay=2.0,
    leases_reconcile_interval=5.0,
)

leases = Leases(app)
