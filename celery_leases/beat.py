"""Beat replicas that send each scheduled run once.

Run as many ``celery beat`` replicas as you like (each with its own schedule file)::

    app.conf.beat_scheduler = "celery_leases.beat:LeasedScheduler"
    # or: celery -A proj beat -S celery_leases.beat:LeasedScheduler

or put the behaviour on another scheduler with the mixin::

    from django_celery_beat.schedulers import DatabaseScheduler
    from celery_leases.beat import LeasedSchedulerMixin

    class Scheduler(LeasedSchedulerMixin, DatabaseScheduler):
        pass

**claim mode** (the default, setting ``beat_mode="claim"``): every replica ticks; just before
sending a due run it claims the run in Redis, and only the replica that wins sends it. A run
is named by the entry and its due run, never by a replica's clock:

- crontab: the due time ``last + delta`` from ``schedule.remaining_delta(last_run_at)``, the
  same on every replica;
- interval (``timedelta``/seconds): the bucket of the Redis clock, ``floor(redis_now /
  run_every)``. After each claim the entry's next due time is moved to the middle of the next
  bucket (on the Redis clock, whatever the replica's own clock says), so every replica looks
  once per bucket and no bucket is skipped while one replica lives;
- other schedules (solar, custom): sent by the leader only (see below).

A replica that loses a claim advances the entry as if it had sent it, so it never retries in a
tight loop. Claims only grow: a replica whose clock lags cannot send a run that was already
sent.

**leader mode** (``beat_mode="leader"``): one replica holds the ``celery_leases:beat:leader``
lease (renewed by the heartbeat) and sends everything; the others stand by and one of them
takes over within the lease TTL after the leader dies.

**When the send fails after the claim**: the run is not sent by anyone (at most once per due
run). Celery's own publish retries apply first; a send that still fails is logged at ERROR by
Celery, exactly as plain beat does when the broker is down, and the next due run is claimed
as usual. Sending it late from another replica could only duplicate it.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from celery.beat import PersistentScheduler, ScheduleEntry, Scheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from celery.utils.log import get_logger

from ._lease import Lease, Want
from .config import get_settings
from .exceptions import LeaseBusy, LeaseError

if TYPE_CHECKING:
    from .app import Leases

__all__ = ("LeasedScheduler", "LeasedSchedulerMixin")

logger = get_logger(__name__)

LEADER_RESOURCE: Final = "celery_leases:beat:leader"


def _replica_name() -> str:
    return f"beat@{socket.gethostname()}/{os.getpid()}"


class LeasedSchedulerMixin:
    """Put on any ``celery.beat.Scheduler`` subclass so that each due run is sent once.

    .. versionadded:: 0.1
    """

    app: Any
    _leases_ext: Leases | None = None
    _leader_lease: Lease | None = None
    _replica: str = ""

    # --- helpers ------------------------------------------------------------------------
    @property
    def leases(self) -> Leases:
        """The Leases of the app (``Leases(app)`` is made here if the app has none)."""
        ext = self._leases_ext
        if ext is None:
            from .app import Leases

            found = getattr(self.app, "leases", None)
            ext = found if isinstance(found, Leases) else Leases(self.app)
            ext._check_settings(full=True)  # beat start: refuse a key changed since first use
            self._leases_ext = ext
        return ext

    @property
    def replica(self) -> str:
        if not self._replica:
            self._replica = _replica_name()
        return self._replica

    @property
    def lease_mode(self) -> str:
        return get_settings(self.app).beat_mode

    @property
    def info(self) -> str:
        base: str = super().info  # type: ignore[misc]
        line = f"leases -> {self.lease_mode} mode, prefix {self.leases.settings.key_prefix!r}"
        return f"{base}\n    . {line}" if base else f". {line}"

    # --- the hook -----------------------------------------------------------------------
    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send ``entry``'s due run if this replica wins it; else only advance."""
        try:
            send = self._should_send(entry)
        except LeaseError as exc:
            logger.error("leases: beat could not claim %s, not sending it: %s", entry.name, exc)
            return
        if send:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        else:
            logger.debug("leases: %s is sent by another replica", entry.name)

    def _should_send(self, entry: ScheduleEntry) -> bool:
        schedule = entry.schedule
        name = str(entry.name or entry.task)
        if self.lease_mode == "leader":
            return self._is_leader()
        if isinstance(schedule, crontab):
            last, delta, _ = schedule.remaining_delta(entry.last_run_at or self._local_now(entry))
            due: datetime = last + delta
            due_ms = round(due.timestamp() * 1000)
            won, _, _, winner = self.leases.store.beat_claim(
                name,
                due_ms=due_ms,
                bucket=None,
                replica=self.replica,
                keep=self._keep(),
            )
            self._log_claim(entry, won, winner, due.isoformat())
            return won
        run_every = getattr(schedule, "run_every", None)
        if isinstance(schedule, interval_schedule) and isinstance(run_every, timedelta):
            every = run_every.total_seconds()
            if not every > 0 or not math.isfinite(every):
                return self._is_leader()
            local_before = self._local_now(entry)
            won, bucket, redis_ms, winner = self.leases.store.beat_claim(
                name,
                due_ms=None,
                bucket=every,
                replica=self.replica,
                keep=max(self._keep(), 3 * every),
            )
            self._align(entry, every, bucket, redis_ms, local_before)
            self._log_claim(entry, won, winner, f"bucket {bucket}")
            return won
        return self._is_leader()

    # --- interval alignment ---------------------------------------------------------------
    def _local_now(self, entry: ScheduleEntry) -> datetime:
        now: datetime = entry.default_now()
        return now

    def _align(
        self,
        entry: ScheduleEntry,
        every: float,
        bucket: int,
        redis_ms: int,
        local_before: datetime,
    ) -> None:
        """Make the entry due again in the middle of the next Redis-time bucket.

        ``offset`` = Redis clock - this replica's clock (as the schedule sees it), measured
        around the claim; the next due time on the Redis clock is ``(bucket + 1.5) * every``,
        which is ``that - offset`` on ours. Skew between replicas therefore does not matter.
        """
        local_after = self._local_now(entry)
        local_mid = local_before + (local_after - local_before) / 2
        offset = redis_ms / 1000 - local_mid.timestamp()
        next_due_local = (bucket + 1.5) * every - offset
        current = self.schedule.get(entry.name)  # type: ignore[attr-defined]
        if current is None:
            return
        last_run = datetime.fromtimestamp(next_due_local - every, tz=local_mid.tzinfo)
        current.last_run_at = last_run
        # the heap holds the time to look at the entry next; tick() re-checks is_due then
        self._heap = None

    def _keep(self) -> float:
        return get_settings(self.app).beat_claim_keep

    def _log_claim(self, entry: ScheduleEntry, won: bool, winner: str, run: str) -> None:
        if won:
            logger.info("leases: beat claimed %s (%s)", entry.name, run)
        else:
            logger.info("leases: beat skips %s (%s): sent by %s", entry.name, run, winner)

    # --- leader mode ----------------------------------------------------------------------
    def _is_leader(self) -> bool:
        lease = self._leader_lease
        if lease is not None:
            if not lease.lost:
                return True
            logger.warning("leases: beat replica %s lost the leader lease", self.replica)
            self.leases.release([lease])
            self._leader_lease = None
        try:
            (lease,) = self.leases.acquire([Want(LEADER_RESOURCE)], wait=0)
        except LeaseBusy:
            return False
        self._leader_lease = lease
        logger.info("leases: beat replica %s is the leader", self.replica)
        return True

    def close(self) -> None:
        lease, self._leader_lease = self._leader_lease, None
        if lease is not None:
            try:
                self.leases.release([lease])
            except LeaseError as exc:
                logger.error("leases: could not release the beat leader lease: %s", exc)
        super().close()  # type: ignore[misc]


class LeasedScheduler(LeasedSchedulerMixin, PersistentScheduler):
    """``PersistentScheduler`` whose replicas send each due run once.

    .. versionadded:: 0.1
    """


class LeasedMemoryScheduler(LeasedSchedulerMixin, Scheduler):
    """The base in-memory ``Scheduler`` whose replicas send each due run once."""
