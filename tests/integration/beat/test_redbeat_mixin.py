"""The redbeat recipe of docs/migration.md: the class on the page, run against the real Redis.

Two instances of the page's ``Scheduler`` on one app stand for two redbeat replicas with
redbeat's own lock turned off. Both load the schedule from Redis before either sends, as two
replicas that tick at the same moment do; the send, ``Scheduler.apply_async``, is replaced by
a recorder. redbeat's schedule and the claims live in Redis under this test's prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab

from celery_leases import Leases
from tests.support.docs_blocks import python_blocks

redbeat = pytest.importorskip("redbeat")


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Scheduler, str]]:
    """Every send of any scheduler: (scheduler, entry name)."""
    record: list[tuple[Scheduler, str]] = []

    def apply_async(
        self: Scheduler, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **_: Any
    ) -> None:
        if advance:  # redbeat's own maybe_due sends with advance=True: reserve as Celery does
            self.reserve(entry)
        record.append((self, str(entry.name)))

    monkeypatch.setattr(Scheduler, "apply_async", apply_async)
    return record


def _page_scheduler() -> type[Scheduler]:
    """The ``Scheduler`` class of the page's redbeat block, executed as written."""
    block = next(b for b in python_blocks("migration.md") if "RedBeatScheduler)" in b)
    namespace: dict[str, Any] = {}
    exec(compile(block, "docs/migration.md", "exec"), namespace)
    cls: type[Scheduler] = namespace["Scheduler"]
    return cls


def _two_replicas_tick_at_once(
    cls: type[Scheduler], app: Celery, sent: list[tuple[Scheduler, str]]
) -> list[tuple[Scheduler, str]]:
    a, b = cls(app), cls(app)
    for s in (a, b):
        s.producer = object()  # apply_async is replaced: no broker connection
    # the entry last ran 150 s ago: the every-minute crontab is due now
    a.schedule["cron"].reschedule(last_run_at=app.now() - timedelta(seconds=150))
    entry_a, entry_b = a.schedule["cron"], b.schedule["cron"]
    a.maybe_due(entry_a, producer=None)
    b.maybe_due(entry_b, producer=None)
    # whoever sent it, the entry saved in Redis has moved past this run
    saved = redbeat.RedBeatSchedulerEntry.from_key(entry_a.key, app=app)
    assert saved.total_run_count == 1
    assert not saved.is_due()[0]
    return sent


def _app(make_leases: Callable[..., Leases], url: str, prefix: str) -> Celery:
    app = Celery("redbeat-mixin", set_as_current=False)
    app.conf.update(
        result_expires=None,
        timezone="UTC",
        beat_schedule={"cron": {"task": "unit.cron", "schedule": crontab()}},
        redbeat_redis_url=url,
        redbeat_key_prefix=f"{{{prefix}}}:redbeat",
        redbeat_lock_key=None,
    )
    make_leases(app)
    return app


def test_page_redbeat_scheduler_sends_a_due_run_once(
    make_leases: Callable[..., Leases],
    leases_redis_url: str,
    leases_prefix: str,
    sent: list[tuple[Scheduler, str]],
) -> None:
    app = _app(make_leases, leases_redis_url, leases_prefix)
    cls = _page_scheduler()
    record = _two_replicas_tick_at_once(cls, app, sent)
    assert [name for _, name in record] == ["cron"]
