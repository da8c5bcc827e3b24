"""redbeat's ``RedBeatScheduler`` with the mixin, composed as docs/beat.md shows.

``beat_app`` sets ``redbeat_lock_key = None`` (unless the test keeps the lock on).
"""

from __future__ import annotations

from redbeat import RedBeatScheduler

from celery_leases.beat import LeasedSchedulerMixin


class Scheduler(LeasedSchedulerMixin, RedBeatScheduler):
    pass
