"""``LeasedMemoryScheduler`` in this process against the real Redis (no beat subprocess).

Two scheduler instances on one app and one key prefix stand for two beat replicas. Each runs
``tick()`` as ``celery beat`` does (reserve the entry, then ``apply_entry``); the send itself,
``Scheduler.apply_async``, is replaced by a recorder. Claims go to Redis as in production.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from celery_leases import Leases
from celery_leases._beat_claims import parse_beat_claim
from celery_leases.beat import LeasedMemoryScheduler
from tests.support.polling import wait_until

#: a schedule that no tick() in these tests reaches twice
HOUR = timedelta(hours=1)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Scheduler, str, datetime]]:
    """Every send of any scheduler: (scheduler, entry name, the entry's last_run_at)."""
    record: list[tuple[Scheduler, str, datetime]] = []

    def apply_async(
        self: Scheduler, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **_: Any
    ) -> None:
        record.append((self, str(entry.name), entry.last_run_at))

    monkeypatch.setattr(Scheduler, "apply_async", apply_async)
    return record


def _app(entries: dict[str, Any]) -> Celery:
    app = Celery("beat-unit", set_as_current=False)
    app.conf.update(result_expires=None, timezone="UTC", beat_schedule=entries)
    return app


def _scheduler(app: Celery, last_run_at: datetime) -> LeasedMemoryScheduler:
    s = LeasedMemoryScheduler(app)
    s.producer = object()  # apply_async is replaced: no broker connection
    for entry in s.schedule.values():
        entry.last_run_at = last_run_at
    return s


def _claim(leases: Leases, entry: str, kind: str) -> tuple[int, str]:
    value = leases.store.client.get(leases.store.keys.beat_claim(entry, kind))
    assert value is not None
    parsed = parse_beat_claim(str(value))  # "<run> <Redis ms> <replica>"
    assert parsed is not None
    run, _, replica = parsed
    return run, replica


def test_same_crontab_run_is_sent_by_one_replica_and_the_other_advances(
    make_leases: Callable[..., Leases], sent: list[tuple[Scheduler, str, datetime]]
) -> None:
    app = _app({"cron": {"task": "unit.cron", "schedule": crontab()}})
    leases = make_leases(app)
    # both replicas last ran the entry at the same moment, so both find the same slot due now
    last = app.now() - timedelta(seconds=150)
    a, b = _scheduler(app, last), _scheduler(app, last)
    start, delta, _ = crontab(app=app).remaining_delta(last)
    slot_ms = round((start + delta).timestamp() * 1000)

    assert a.tick() == 0  # 0: it ran the due entry
    assert b.tick() == 0
    assert [(s, name, at) for s, name, at in sent] == [(a, "cron", last)]
    assert _claim(leases, "cron", "cron") == (slot_ms, a.replica)

    # the loser advanced its entry as reserve() does, without sending
    for s in (a, b):
        entry = s.schedule["cron"]
        assert entry.total_run_count == 1
        assert entry.last_run_at > last + timedelta(seconds=120)
        assert entry.is_due().is_due is False
    assert b.tick() > 0
    assert len(sent) == 1
    a.close()
    b.close()


def test_an_older_crontab_run_than_the_last_claimed_is_not_sent(
    make_leases: Callable[..., Leases], sent: list[tuple[Scheduler, str, datetime]]
) -> None:
    """A replica that lags (its entry last ran a slot earlier) cannot send an older slot."""
    app = _app({"cron": {"task": "unit.cron", "schedule": crontab()}})
    make_leases(app)
    now = app.now()
    ahead = _scheduler(app, now - timedelta(seconds=90))
    behind = _scheduler(app, now - timedelta(seconds=150))
    ahead.tick()
    behind.tick()
    assert [s for s, _, _ in sent] == [ahead]
    assert behind.schedule["cron"].total_run_count == 1
    ahead.close()
    behind.close()


def test_a_skipped_older_crontab_run_does_not_name_the_winner_of_a_later_run(
    make_leases: Callable[..., Leases],
    sent: list[tuple[Scheduler, str, datetime]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The claim key holds the winner of the last claimed run only. A replica that presents
    an older run must not be told (nor log) that the later run's winner sent it."""
    app = _app({"cron": {"task": "unit.cron", "schedule": crontab()}})
    make_leases(app)
    now = app.now()
    ahead = _scheduler(app, now - timedelta(seconds=90))
    behind = _scheduler(app, now - timedelta(seconds=150))
    same = _scheduler(app, now - timedelta(seconds=90))
    ahead.tick()
    caplog.set_level("INFO", logger="celery_leases.beat")
    behind.tick()
    same.tick()
    skips = [r.getMessage() for r in caplog.records if "beat skips" in r.getMessage()]
    assert len(skips) == 2, skips
    older, equal = skips
    assert ahead.replica not in older, f"{older!r} names the winner of a later run"
    assert older.endswith(": a later run is claimed")
    assert equal.endswith(f": sent by {ahead.replica}")
    assert [s for s, _, _ in sent] == [ahead]
    for s in (ahead, behind, same):
        s.close()


def test_a_crontab_claim_outlives_beat_claim_keep_when_the_period_is_longer(
    make_leases: Callable[..., Leases], sent: list[tuple[Scheduler, str, datetime]]
) -> None:
    """A weekly job and a 24 h keep, scaled down: a minutely crontab and a 1 s keep.

    Timeline: t0 replica A claims and sends a run; t1 the keep has passed, the next run is not
    due yet (nothing renewed the claim); t2 replica B, which was down, presents that same run
    (its entry last ran before it). B must lose.
    """
    keep = 1.0
    app = _app({"cron": {"task": "unit.cron", "schedule": crontab()}})
    leases = make_leases(app, beat_claim_keep=keep)
    client, key = leases.store.client, leases.store.keys.beat_claim("cron", "cron")
    last = app.now() - timedelta(seconds=150)
    a, b = _scheduler(app, last), _scheduler(app, last)

    assert a.tick() == 0  # t0
    claimed_at = leases.store.redis_time()
    assert [s for s, _, _ in sent] == [a]
    # t1: the old keep has passed on the Redis clock
    wait_until(lambda: leases.store.redis_time() > claimed_at + keep + 0.2, 10, "keep to pass")

    assert b.tick() == 0  # t2
    assert [s for s, _, _ in sent] == [a], "a replica sent a run already sent (claim forgotten)"
    assert b.schedule["cron"].total_run_count == 1  # it advanced past the run it lost
    # A's claim is remembered for 3 periods of the schedule (60 s each), not beat_claim_keep
    assert _claim(leases, "cron", "cron")[1] == a.replica
    assert client.pttl(key) > 2 * 60 * 1000
    a.close()
    b.close()


def test_crontab_claims_are_kept_three_gaps_to_the_next_run(
    make_leases: Callable[..., Leases],
) -> None:
    """Each claim measures its own gap: Friday's run of a weekday job is followed by three days."""
    day = 86400.0
    weekdays = crontab(minute=0, hour=9, day_of_week="mon-fri")
    app = _app({"weekdays": {"task": "unit.cron", "schedule": weekdays}})
    make_leases(app, beat_claim_keep=3600.0)
    s = _scheduler(app, app.now())
    schedule = s.schedule["weekdays"].schedule
    utc = timezone.utc
    thursday, friday = datetime(2026, 12, 3, 9, tzinfo=utc), datetime(2026, 12, 4, 9, tzinfo=utc)
    assert s._cron_keep(schedule, thursday) == 3 * day
    assert s._cron_keep(schedule, friday) == 3 * 3 * day
    # a schedule whose gaps are short keeps beat_claim_keep
    assert s._cron_keep(crontab(app=app), thursday) == 3600.0
    s.close()


@pytest.mark.parametrize("skew", [0.0, 7.0, -5.0])
def test_interval_run_sent_once_and_both_replicas_aligned_on_the_redis_clock(
    skew: float, make_leases: Callable[..., Leases], sent: list[tuple[Scheduler, str, datetime]]
) -> None:
    """Both replicas claim the same Redis-time bucket; one sends; both are next due in the
    middle of the next bucket on the Redis clock, whatever their own clock says."""
    app = _app({})
    leases = make_leases(app)
    off = timedelta(seconds=skew)
    replicas = []
    for _ in range(2):
        # a clock of its own per replica (skewed by ``skew``), as beat reads it
        every = schedule(HOUR, nowfun=lambda: app.now() + off, app=app)
        app.conf.beat_schedule = {"hourly": {"task": "unit.hourly", "schedule": every}}
        replicas.append(_scheduler(app, app.now() + off - 2 * HOUR))
    a, b = replicas

    a.tick()
    b.tick()
    assert [s for s, _, _ in sent] == [a]
    bucket, winner = _claim(leases, "hourly", "every")
    assert winner == a.replica
    sec, _ = leases.store.client.time()
    assert bucket == int(sec) // 3600

    middle_of_next = (bucket + 1.5) * 3600  # on the Redis clock
    for s in (a, b):
        entry = s.schedule["hourly"]
        next_due = (entry.last_run_at + HOUR).timestamp() - skew  # on the Redis clock
        assert next_due == pytest.approx(middle_of_next, abs=0.25)
        assert entry.is_due().is_due is False
    assert b.tick() > 0
    assert len(sent) == 1
    a.close()
    b.close()
