"""Beat runs are judged on the Redis clock, whatever the replicas' start phases and clocks.

``LeasedMemoryScheduler`` replicas run in this process, each on its own simulated clock (the
``nowfun`` of its schedules), against a private Redis server whose clock the test sets too
(``tests/support/clockshift.py``): every instant is chosen, nothing depends on the machine's
speed. Each step moves the clocks on, then every live replica ticks as ``celery beat`` does;
the send itself (``Scheduler.apply_async``) is replaced by a recorder of the Redis time.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from celery_leases import Leases
from celery_leases._redis_server import RedisServer
from celery_leases.beat import LeasedMemoryScheduler
from tests.support.clockshift import RedisClock, clocked_server

#: a bucket boundary of a 2 s interval (an even epoch second), far from any real clock
BOUNDARY = 1_900_000_000.0
#: 10:00:00 UTC of some day
TEN = datetime(2030, 3, 4, 10, 0, tzinfo=timezone.utc).timestamp()


#: a replica's beat_schedule, made from its clock (the ``nowfun`` of its schedules)
Entries = Callable[[Callable[[], datetime]], dict[str, Any]]


@dataclass
class Replica:
    name: str
    scheduler: LeasedMemoryScheduler
    skew: float = 0.0  # seconds its clock is ahead of the Redis clock
    alive: bool = True


class Fleet:
    """Replicas on simulated clocks, and the Redis clock they are judged on."""

    def __init__(
        self,
        make_leases: Callable[..., Leases],
        server: RedisServer,
        clock: RedisClock,
        now: float,
    ) -> None:
        self.make_leases = make_leases
        self.server = server
        self.clock = clock
        self.now = now  # the true time (= the Redis clock)
        self.replicas: list[Replica] = []
        self.sent: list[tuple[str, str, float]] = []  # (replica, entry, Redis time)
        clock.set(now)

    def add(self, name: str, entries: Entries) -> Replica:
        """Start replica ``name`` now; ``entries(nowfun)`` gives its beat_schedule."""
        replica = Replica(name, None)  # type: ignore[arg-type]

        def nowfun() -> datetime:
            return datetime.fromtimestamp(self.now + replica.skew, tz=timezone.utc)

        app = Celery(f"clocks-{name}", set_as_current=False)
        app.conf.update(result_expires=None, timezone="UTC", beat_schedule=entries(nowfun))
        self.make_leases(app, redis_url=self.server.url)
        scheduler = LeasedMemoryScheduler(app)
        scheduler.producer = object()  # apply_async is replaced: no broker connection
        scheduler._replica = name
        replica.scheduler = scheduler
        self.replicas.append(replica)
        return replica

    def run_until(self, end: float, step: float, at: Callable[[float], None] | None = None) -> None:
        """Move the clocks on by ``step`` up to ``end``; every live replica ticks each step."""
        while self.now < end - 1e-9:
            self.now = round(self.now + step, 6)
            if at is not None:
                at(self.now)
            self.clock.set(self.now)
            for replica in self.replicas:
                if replica.alive:
                    for _ in range(10):  # tick() sends one due entry per call and returns 0
                        if replica.scheduler.tick() != 0:
                            break

    def close(self) -> None:
        for replica in self.replicas:
            replica.scheduler.close()


@pytest.fixture
def fleet(
    make_leases: Callable[..., Leases],
    make_redis_server: Callable[..., RedisServer],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[float], Fleet]]:
    made: list[Fleet] = []

    def make(now: float) -> Fleet:
        server, clock = clocked_server(make_redis_server, now)
        f = Fleet(make_leases, server, clock, now)

        def apply_async(
            self: Scheduler, entry: ScheduleEntry, producer: Any = None, **_: Any
        ) -> None:
            f.sent.append((getattr(self, "_replica", "?"), str(entry.name), f.now))

        monkeypatch.setattr(Scheduler, "apply_async", apply_async)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def _every(seconds: float) -> Entries:
    def entries(nowfun: Callable[[], datetime]) -> dict[str, Any]:
        run_every = timedelta(seconds=seconds)
        return {"tick": {"task": "clocks.tick", "schedule": schedule(run_every, nowfun=nowfun)}}

    return entries


def _minutely(nowfun: Callable[[], datetime]) -> dict[str, Any]:
    return {"cron": {"task": "clocks.cron", "schedule": crontab(minute="*", nowfun=nowfun)}}


def _hhmm(minutes: list[int]) -> list[str]:
    return [datetime.fromtimestamp(m * 60, tz=timezone.utc).strftime("%H:%M") for m in minutes]


def _assert_interval_runs(sent: list[tuple[str, str, float]], every: float, end: float) -> None:
    times = [at for _, _, at in sent]
    assert times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= every / 2 - 1e-6, f"runs {min(gaps):.3f}s apart: {sent[:4]}"
    # one run in every bucket of the Redis clock from the first run's on (the last bucket
    # may still be waiting for its run, due in its middle)
    buckets = [math.floor(at / every) for at in times]
    expected = list(range(buckets[0], math.floor(end / every)))
    assert buckets[: len(expected)] == expected, f"buckets {buckets} (sent {sent})"


def test_interval_runs_of_replicas_straddling_a_bucket_boundary_are_half_an_interval_apart(
    fleet: Callable[[float], Fleet],
) -> None:
    """Issue 26 part 3: A's first due time falls 50 ms before a boundary of the Redis clock's
    buckets, B's 50 ms after it (started 100 ms apart). Before the fix: runs 0.1 s apart."""
    every = 2.0
    f = fleet(BOUNDARY - every - 0.05)
    f.add("A", _every(every))  # first due: its start + the interval = BOUNDARY - 0.05
    f.run_until(BOUNDARY - every + 0.05, 0.01)
    f.add("B", _every(every))  # first due: BOUNDARY + 0.05
    end = BOUNDARY + 20 * every
    f.run_until(end, 0.01)
    assert {r for r, _, _ in f.sent} <= {"A", "B"}
    assert f.sent[0][0] == "A"
    assert f.sent[0][2] == pytest.approx(BOUNDARY - 0.05)
    _assert_interval_runs(f.sent, every, end)


def test_no_bucket_is_missed_when_the_first_runs_replica_dies(
    fleet: Callable[[float], Fleet],
) -> None:
    """A claims the bucket before the boundary and dies; B, refused as too soon just after the
    boundary, must still send that next bucket's run (half an interval after A's)."""
    every = 2.0
    f = fleet(BOUNDARY - every - 0.05)
    a = f.add("A", _every(every))
    f.run_until(BOUNDARY - every + 0.05, 0.01)
    f.add("B", _every(every))
    f.run_until(BOUNDARY - 0.04, 0.01)
    assert [r for r, _, _ in f.sent] == ["A"]
    a.alive = False
    end = BOUNDARY + 10 * every
    f.run_until(end, 0.01)
    assert [r for r, _, _ in f.sent[1:]] == ["B"] * (len(f.sent) - 1)
    _assert_interval_runs(f.sent, every, end)


def test_a_replica_whose_clock_jumps_an_hour_ahead_neither_doubles_nor_silences_a_crontab(
    fleet: Callable[[float], Fleet], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 26 part 3b: B's clock is right; A's jumps +1 h at 10:10:30 and is stepped back at
    10:40:30. Before the fix: A sent 10:11 thirty seconds early, then claimed runs named
    11:xx, so that nobody sent from 10:41 to 11:40 (60 runs missed), one run sent twice."""
    caplog.set_level(logging.INFO, logger="celery_leases.beat")
    f = fleet(TEN)
    a = f.add("A", _minutely)
    f.add("B", _minutely)

    def jumps(now: float) -> None:
        if now == TEN + 630:  # 10:10:30
            a.skew = 3600.0
        elif now == TEN + 2430:  # 10:40:30
            a.skew = 0.0

    end = TEN + 105 * 60
    f.run_until(end, 0.5, jumps)
    tolerance = 1.0  # beat_clock_tolerance's default
    minutes = [math.floor((at + tolerance) / 60) for _, _, at in f.sent]
    due = list(range(int(TEN) // 60 + 1, int(end) // 60 + 1))  # 10:01 .. 11:45
    doubled = _hhmm(sorted({m for m in minutes if minutes.count(m) > 1}))
    missed = _hhmm(sorted(set(due) - set(minutes)))
    assert not doubled, f"sent twice: {doubled}; missed ({len(missed)}): {missed}"
    assert not missed, f"missed ({len(missed)}): {missed}"
    assert minutes == due
    # never sent before its minute is due by more than the tolerance, on the Redis clock
    assert all(at >= m * 60 - tolerance for m, (_, _, at) in zip(minutes, f.sent, strict=True))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("replica A's clock is 3600" in w and "ahead of" in w for w in warnings), warnings
    assert not any("replica B's" in w for w in warnings), warnings


def test_a_replica_alone_with_its_clock_ahead_sends_each_crontab_run_on_time(
    fleet: Callable[[float], Fleet],
) -> None:
    """A run due in the future on the Redis clock is held, not dropped: a lone replica whose
    clock is 30 s ahead still sends every run, when it is due on the Redis clock."""
    f = fleet(TEN)
    a = f.add("A", _minutely)
    a.skew = 30.0
    end = TEN + 10 * 60
    f.run_until(end, 0.5)
    times = [at for _, _, at in f.sent]
    due = [TEN + 60 * k for k in range(1, 11)]
    assert len(times) == len(due), times
    for at, d in zip(times, due, strict=True):
        assert d <= at <= d + 1.0, (at - d, times)  # held until due, then sent at once


def test_the_clock_offset_is_a_metric(fleet: Callable[[float], Fleet]) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_leases import metrics

    registry = prometheus_client.CollectorRegistry()
    installed = metrics.install(registry)
    try:
        f = fleet(TEN)
        a = f.add("A", _minutely)
        a.skew = 30.0
        f.run_until(TEN + 61, 0.5)
        offset = registry.get_sample_value("celery_leases_beat_clock_offset_seconds")
        assert offset == pytest.approx(-30.0)
    finally:
        installed.uninstall()
