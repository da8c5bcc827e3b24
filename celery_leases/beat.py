"""Beat replicas that send each scheduled run once.

Run as many ``celery beat`` replicas as you like (each with its own schedule file)::

    app.conf.beat_scheduler = "celery_leases.beat:LeasedScheduler"
    # or: celery -A proj beat -S celery_leases.beat:LeasedScheduler

or put the behaviour on another scheduler with the mixin::

    from django_celery_beat.schedulers import DatabaseScheduler
    from celery_leases.beat import LeasedSchedulerMixin

    class Scheduler(LeasedSchedulerMixin, DatabaseScheduler):
        pass

(redbeat's ``RedBeatScheduler`` likewise, with ``app.conf.redbeat_lock_key = None``: its lock
would make one replica the only ticker, and block the others for its ``lock_timeout`` after
that replica dies).

**claim mode** (the default, setting ``beat_mode="claim"``): every replica ticks; just before
sending a due run it claims the run in Redis, and only the replica that wins sends it. A run
is named by the entry and its due run, never by a replica's clock, and each claim is judged
on the Redis clock:

- crontab: the due time ``last + delta`` from ``schedule.remaining_delta(last_run_at)``. A
  run due more than ``beat_clock_tolerance`` ahead of the Redis clock is not claimable yet:
  the replica holds the entry and presents it again when it is due on the Redis clock. The
  next run is named from the Redis time of the claim;
- interval (``timedelta``/seconds): the bucket of the Redis clock, ``floor(redis_now /
  run_every)``; a run less than half an interval after the last claimed one is refused, and
  the replica looks again when it may claim it. After each claim the entry's next due time is
  moved to the middle of the next bucket (on the Redis clock, whatever the replica's own
  clock says), so every replica looks once per bucket and no bucket is skipped while one
  replica lives;
- other schedules (solar, custom): sent by the leader only (see below).

A replica whose clock disagrees with Redis's by more than ``beat_clock_tolerance`` logs a
warning; the offset is the metric ``celery_leases_beat_clock_offset_seconds``.

A replica that loses a claim advances the entry as if it had sent it, so it never retries in a
tight loop. Claims only grow: a replica whose clock lags cannot send a run that was already
sent. An entry's last claim is remembered ``beat_claim_keep`` seconds, and a crontab's at least
three gaps to its next run (a weekly job's for three weeks), so it outlives the next claim.

**leader mode** (``beat_mode="leader"``): one replica holds the ``celery_leases:beat:leader``
lease (renewed by the heartbeat) and sends everything; the others stand by and one of them
takes over within the lease TTL after the leader dies.

**Per entry**, in the entry's ``options`` (checked at start-up, never passed to Celery):
``leases_overlap`` (``"allow"``, ``"skip"``: no run is sent while the entry's previous run is
queued or running; ``"buffer_one"``: one such run waits and is sent once the previous one
ends) and ``leases_catchup_window`` (seconds: after every replica was down, one catch-up run
if the latest missed due time is that recent; without it, none, and the entry waits for its
next due time; claim mode only). See docs/beat.md, "Overlap and catch-up, per entry".

**When the send fails after the claim**: the run is not sent by anyone (at most once per due
run). Celery's own publish retries apply first; a send that still fails is logged at ERROR by
Celery, exactly as plain beat does when the broker is down, and the next due run is claimed
as usual. Sending it late from another replica could only duplicate it.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from celery.beat import PersistentScheduler, ScheduleEntry, Scheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from celery.utils.log import get_logger

from ._beat_claims import SKIPPED_BY
from ._beat_runs import (
    BUFFER_POLL,
    EntryPolicy,
    RunGate,
    check_entries,
    check_kept,
    cron_after,
    cron_latest,
    entry_policy,
)
from ._identity import set_process_kind
from ._lease import Lease, Want
from .config import get_settings
from .exceptions import LeaseBusy, LeaseError

if TYPE_CHECKING:
    from ._beat_claims import BeatClaim
    from .app import Leases

__all__ = ("LeasedScheduler", "LeasedSchedulerMixin", "clock_observers")

#: called with (replica, seconds the Redis clock is ahead of the replica's) after each claim
ClockObserver = Callable[[str, float], None]
clock_observers: Final[list[ClockObserver]] = []

logger = get_logger(__name__)

LEADER_RESOURCE: Final = "celery_leases:beat:leader"
#: a crontab claim is kept at least this many gaps to the schedule's next run
_CLAIM_PERIODS: Final = 3
#: seconds between two warnings that a replica's clock disagrees with Redis's
_SKEW_WARN_EVERY: Final = 300.0
#: seconds after the Redis time a refused interval run may be claimed that a replica looks
#: again (the offset between the clocks is measured to a round trip)
_RETRY_MARGIN: Final = 0.02


@dataclass(frozen=True)
class _Decision:
    """What a claim decided: send?, the ``last_run_at`` that names the entry's next run on
    the Redis clock (None: the scheduler's own), and whether the run is held (not due yet on
    the Redis clock: the entry is not advanced, and is looked at again at ``hold_until``)."""

    send: bool
    last_run_at: datetime | None = None
    hold_until: float | None = None  # local epoch seconds


def _replica_name() -> str:
    return f"beat@{socket.gethostname()}/{os.getpid()}"


def _is_redbeat_entry(entry: ScheduleEntry) -> bool:
    """Whether ``entry`` is redbeat's ``RedBeatSchedulerEntry`` (redbeat is not imported)."""
    return any(
        cls.__name__ == "RedBeatSchedulerEntry" and cls.__module__.startswith("redbeat.")
        for cls in type(entry).__mro__
    )


def _name_beat_process(ext: Leases) -> None:
    """Name this process's node as a beat's (``<program>:beat:<pid>@<host>``).

    A worker frees, at start-up, the leases of every owner of its own node name with another
    incarnation; a beat must never share a worker's name, or the first worker to start frees
    the beat's leader lease (two leaders). A worker's name always has an ``@``
    (``celery.utils.nodenames``), so a ``node`` setting without one is safe here.
    """
    set_process_kind("beat")
    node = ext.settings.node
    if node is not None and "@" in node:
        logger.warning(
            "leases: beat uses the node name %r of the node setting; a worker started with "
            "that name frees this beat's leases (its leader lease too) at start-up. Leave "
            "node unset in beat, or use a name without '@' (no worker has one)",
            node,
        )


def _log_outage(entry: ScheduleEntry, run: str, caught_up: bool) -> None:
    """Log a run of an outage (due while no replica ran): caught up, or skipped."""
    if caught_up:
        logger.info("leases: beat catches up %s (%s): runs were missed", entry.name, run)
    else:
        logger.info(
            "leases: beat skips %s (%s): missed while no replica ran, no catch-up "
            "(leases_catchup_window)",
            entry.name,
            run,
        )


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
            from .app import Leases, checked_settings, find_leases

            ext = find_leases(self.app) or Leases(self.app)
            checked_settings(ext, full=True)  # beat start: refuse a key changed since first use
            self._leases_ext = ext
            _name_beat_process(ext)
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

    _lock_checked: bool = False
    _gate: RunGate | None = None

    def setup_schedule(self) -> None:
        """Set up the scheduler's schedule, after checking the entries' lease options."""
        check_entries(self.app.conf.beat_schedule or {}, self.lease_mode)
        super().setup_schedule()  # type: ignore[misc]
        check_kept(self.app.conf.beat_schedule or {}, self.schedule)  # type: ignore[attr-defined]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Run the scheduler's tick (the first one also checks for redbeat's lock), then
        send a buffered run whose previous run ended (``leases_overlap="buffer_one"``)."""
        if not self._lock_checked:
            # here, not in the banner: beat prints the banner before it sets up logging
            self._lock_checked = True
            self._warn_redbeat_lock()
        interval: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        if self._gate is not None and self._gate.poll(self.leases):
            interval = min(interval, BUFFER_POLL)
        return interval

    def _warn_redbeat_lock(self) -> None:
        lock_key = getattr(self, "lock_key", None)  # redbeat's leader lock
        if lock_key and self.lease_mode == "claim":
            logger.warning(
                "leases: redbeat's lock %r is on: only the replica that holds it ticks, and "
                "after it dies the others wait up to its lock_timeout (%ss) before one takes "
                "over. The claims send each run once without it: set redbeat_lock_key = None",
                lock_key,
                getattr(self, "lock_timeout", "?"),
            )

    # --- the hooks ----------------------------------------------------------------------
    # A due run is claimed where the scheduler advances the entry past it, once per due run
    # per replica, and sent only by the winner:
    #
    # - ``Scheduler.tick`` (the base and persistent schedulers, django-celery-beat's
    #   ``DatabaseScheduler``) calls ``reserve(entry)``, then ``apply_entry(entry)``, which
    #   sends with ``apply_async(entry, advance=False)``;
    # - redbeat's ``RedBeatScheduler.tick`` never calls ``apply_entry``: its ``maybe_due`` calls
    #   ``apply_async(entry)`` (``advance=True``), which reserves and sends in one go.
    #
    # So ``reserve`` claims and leaves its decision for ``apply_entry``, and ``apply_async``
    # claims itself when it is asked to advance. Winners and losers advance alike, in the
    # scheduler's own store (its reserve: the schedule file, the database row, redbeat's hash).

    def is_due(self, entry: ScheduleEntry) -> Any:
        """The scheduler's ``is_due``, except for a crontab run held until the Redis clock
        reaches it (this replica's clock runs ahead): ``(False, seconds left)`` until then."""
        holds = self._hold_times()
        held = holds.get(str(entry.name))
        if held is not None:
            left = held - self._local_now(entry).timestamp()
            if left > 0:
                return False, left
            del holds[str(entry.name)]
        return super().is_due(entry)  # type: ignore[misc]

    def reserve(self, entry: ScheduleEntry) -> Any:  # celery-types says event_t: it is wrong
        """Claim ``entry``'s due run, then advance the entry past it (winner or loser); a run
        not yet due on the Redis clock is held: the entry is not advanced."""
        new_entry, send, realigned = self._claim_and_advance(entry, hold=True)
        name = entry.name
        # django-celery-beat's reserve leaves the old entry (and its old last_run_at) in
        # self.schedule; the heap is rebuilt from there (below, and whenever the schedule
        # changes), so it must hold the advanced entry, or the run is claimed again each tick
        schedule = self.schedule  # type: ignore[attr-defined]
        if name in schedule and schedule[name] is not new_entry:
            schedule[name] = new_entry
        if realigned:
            # the heap holds the time to look at the entry next; tick() re-checks is_due then
            self._heap = None
        self._pending = (entry, send)
        return new_entry

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send ``entry``'s due run if this replica won it in ``reserve``; else do nothing."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is entry:
            send = pending[1]
        else:  # called without reserve(): claim now (the entry is not advanced here)
            decision = self._claim(entry)
            send = decision.send
            current = self.schedule.get(entry.name)  # type: ignore[attr-defined]
            if decision.last_run_at is not None and current is not None:
                self._store_last_run_at(current, decision.last_run_at)
                self._heap = None
        if send:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        else:
            logger.debug("leases: %s is sent by another replica", entry.name)

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Send ``entry``; with ``advance`` (redbeat's ``maybe_due``), only if this replica
        wins the due run, advancing the entry either way. Returns the result, or None."""
        if advance:
            new_entry, send, _ = self._claim_and_advance(entry, hold=False)
            if not send:
                logger.debug("leases: %s is sent by another replica", entry.name)
                return None
            entry = new_entry
        if self._gate is None:
            self._gate = RunGate()
        base = super().apply_async  # type: ignore[misc]
        # the entry's lease options are checked and stripped, its overlap policy applied
        return self._gate.send(
            self.leases, entry, lambda e: base(e, producer=producer, advance=False, **kwargs)
        )

    _pending: tuple[ScheduleEntry, bool] | None = None
    #: entry name -> local epoch seconds until which its crontab run is held
    _holds: dict[str, float] | None = None
    _skew_warned: float = 0.0

    def _hold_times(self) -> dict[str, float]:
        if self._holds is None:
            self._holds = {}
        return self._holds

    def _claim_and_advance(
        self, entry: ScheduleEntry, *, hold: bool
    ) -> tuple[ScheduleEntry, bool, bool]:
        """Claim the due run, advance the entry with the scheduler's ``reserve``.

        A run held (not yet due on the Redis clock) leaves the entry as it is when ``hold``
        (the scheduler asks :meth:`is_due` before it looks again), else advances it as lost.

        Returns ``(advanced entry, send it?, heap to rebuild?)``.
        """
        decision = self._claim(entry)
        if decision.hold_until is not None:
            if hold:
                self._hold_times()[str(entry.name)] = decision.hold_until
                return entry, False, True
            new_entry: ScheduleEntry = super().reserve(entry)  # type: ignore[misc]
            return new_entry, False, False
        new_entry = super().reserve(entry)  # type: ignore[misc]
        if decision.last_run_at is not None:
            self._store_last_run_at(new_entry, decision.last_run_at)
        return new_entry, decision.send, decision.last_run_at is not None

    def _claim(self, entry: ScheduleEntry) -> _Decision:
        try:
            return self._should_send(entry)
        except LeaseError as exc:
            logger.error("leases: beat could not claim %s, not sending it: %s", entry.name, exc)
            return _Decision(False)

    def _should_send(self, entry: ScheduleEntry) -> _Decision:
        schedule = entry.schedule
        name = str(entry.name or entry.task)
        if self.lease_mode == "leader":
            return _Decision(self._is_leader())
        if isinstance(schedule, crontab):
            last, delta, _ = schedule.remaining_delta(entry.last_run_at or self._local_now(entry))
            due: datetime = last + delta
            local_before = self._local_now(entry)
            after = cron_after(schedule, due)
            claim = self._claim_cron(entry, name, due, after, latest=False)
            if claim.refused == "missed":  # an outage: present the latest due run instead
                due = cron_latest(schedule, due, claim.now_ms)
                claim = self._claim_cron(entry, name, due, None, latest=True)
            offset = self._clock_offset(entry, claim, local_before)
            if claim.refused == "future":
                assert claim.retry_ms is not None
                ahead = due.timestamp() - claim.now_ms / 1000
                logger.info(
                    "leases: beat holds %s (%s): due in %.1fs on the Redis clock",
                    entry.name,
                    due.isoformat(),
                    ahead,
                )
                return _Decision(False, hold_until=claim.retry_ms / 1000 - offset)
            if claim.refused == "skipped" or claim.catch_up:
                _log_outage(entry, due.isoformat(), claim.catch_up)
            if claim.refused != "skipped":
                self._log_claim(entry, claim.won, claim.winner, due.isoformat())
            # name the next run from the Redis clock, never from this replica's: a clock
            # that jumps ahead must not make the next run presented one far in the future
            redis_now = datetime.fromtimestamp(claim.now_ms / 1000, tz=due.tzinfo)
            return _Decision(claim.won, max(redis_now, due))
        run_every = getattr(schedule, "run_every", None)
        if isinstance(schedule, interval_schedule) and isinstance(run_every, timedelta):
            every = run_every.total_seconds()
            if not every > 0 or not math.isfinite(every):
                return _Decision(self._is_leader())
            local_before = self._local_now(entry)
            claim = self.leases.store.claim_beat_run(
                name,
                due_ms=None,
                bucket=every,
                replica=self.replica,
                keep=max(self._keep(), 3 * every),
                catch_up=self._policy(entry).catchup_window,
            )
            offset = self._clock_offset(entry, claim, local_before)
            if claim.refused == "skipped":  # missed in an outage: the next run is at retry
                assert claim.retry_ms is not None
                _log_outage(entry, f"bucket {claim.run}", claim.catch_up)
                next_due = claim.retry_ms / 1000 + _RETRY_MARGIN - offset
                return _Decision(False, self._local_datetime(next_due - every, local_before))
            if claim.refused == "early":
                # the last run was claimed less than half an interval ago (on the Redis
                # clock): look again when this bucket's run may be claimed
                assert claim.retry_ms is not None
                logger.info(
                    "leases: beat skips %s (bucket %s): too soon after the last run, "
                    "looks again in %.3fs",
                    entry.name,
                    claim.run,
                    claim.retry_ms / 1000 - claim.now_ms / 1000,
                )
                next_due = claim.retry_ms / 1000 + _RETRY_MARGIN - offset
                return _Decision(False, self._local_datetime(next_due - every, local_before))
            if claim.catch_up:
                _log_outage(entry, f"bucket {claim.run}", True)
            self._log_claim(entry, claim.won, claim.winner, f"bucket {claim.run}")
            next_due = (claim.run + 1.5) * every - offset
            return _Decision(claim.won, self._local_datetime(next_due - every, local_before))
        return _Decision(self._is_leader())

    def _claim_cron(
        self, entry: ScheduleEntry, name: str, due: datetime, after: datetime | None, latest: bool
    ) -> BeatClaim:
        """Claim crontab run ``due`` (``after``: the run after it; ``latest``: after an outage,
        the latest due run)."""
        schedule = entry.schedule
        assert isinstance(schedule, crontab)
        return self.leases.store.claim_beat_run(
            name,
            due_ms=round(due.timestamp() * 1000),
            bucket=None,
            replica=self.replica,
            keep=self._cron_keep(schedule, due),
            tolerance=self._tolerance(),
            catch_up=self._policy(entry).catchup_window,
            next_due_ms=None if after is None else round(after.timestamp() * 1000),
            latest=latest,
        )

    def _policy(self, entry: ScheduleEntry) -> EntryPolicy:
        return entry_policy(str(entry.name or entry.task), entry.options)

    # --- clocks ---------------------------------------------------------------------------
    def _tolerance(self) -> float:
        return get_settings(self.app).beat_clock_tolerance

    def _clock_offset(self, entry: ScheduleEntry, claim: BeatClaim, before: datetime) -> float:
        """Seconds the Redis clock is ahead of this replica's (as the schedule sees it),
        measured around ``claim``; tells the observers, and warns when it is off by more
        than ``beat_clock_tolerance``."""
        after = self._local_now(entry)
        mid = before + (after - before) / 2
        offset = claim.now_ms / 1000 - mid.timestamp()
        for observer in tuple(clock_observers):
            try:
                observer(self.replica, offset)
            except Exception:  # an observer's bug must not stop beat
                logger.exception("leases: beat clock observer failed")
        tolerance = self._tolerance()
        if abs(offset) > tolerance:
            now = time.monotonic()
            if not self._skew_warned or now - self._skew_warned >= _SKEW_WARN_EVERY:
                self._skew_warned = now
                logger.warning(
                    "leases: beat replica %s's clock is %.3fs %s Redis's (more than "
                    "beat_clock_tolerance, %ss): its runs are judged on the Redis clock; "
                    "fix this host's time (NTP)",
                    self.replica,
                    abs(offset),
                    "behind" if offset > 0 else "ahead of",
                    tolerance,
                )
        elif self._skew_warned:
            self._skew_warned = 0.0
            logger.info("leases: beat replica %s's clock agrees with Redis's again", self.replica)
        return offset

    def _local_datetime(self, epoch: float, like: datetime) -> datetime:
        return datetime.fromtimestamp(epoch, tz=like.tzinfo)

    # --- the entry's store -----------------------------------------------------------------
    def _local_now(self, entry: ScheduleEntry) -> datetime:
        now: datetime = entry.default_now()
        return now

    def _store_last_run_at(self, entry: ScheduleEntry, last_run_at: datetime) -> None:
        """Set an advanced entry's ``last_run_at`` where its scheduler keeps it."""
        entry.last_run_at = last_run_at
        model = getattr(entry, "model", None)
        if model is not None and hasattr(model, "last_run_at"):
            # django-celery-beat's ModelEntry: sync() writes the row from the model
            model.last_run_at = last_run_at
        if _is_redbeat_entry(entry):
            # redbeat keeps it in Redis (the entry's meta and its score in the schedule);
            # this is how redbeat itself moves last_run_at without counting a run
            entry._next_instance(last_run_at=last_run_at, only_update_last_run_at=True)  # type: ignore[attr-defined]

    def _keep(self) -> float:
        return get_settings(self.app).beat_claim_keep

    def _cron_keep(self, schedule: crontab, due: datetime) -> float:
        """Seconds to remember the claim of crontab run ``due``: ``beat_claim_keep`` or more.

        The claim key holds the last claimed run; a replica that lagged or was down presents
        the run after its own ``last_run_at``, an older one, and must lose. The next claim
        renews the key, so it has to outlive the gap to the next run: a key kept 24 h after a
        weekly run was gone when a replica came back on day two, and that replica sent the
        run again. So the claim is kept :data:`_CLAIM_PERIODS` times the gap from ``due`` to
        the run after it (each claim measures its own gap: Friday's run of a weekday crontab
        is followed by three days), and never less than ``beat_claim_keep``.
        """
        keep = self._keep()
        try:
            start, delta, _ = schedule.remaining_delta(due)
            gap = (start + delta - due).total_seconds()
        except (ValueError, OverflowError) as exc:  # a crontab with no run after this one
            logger.debug("leases: no run of %s after %s: %s", schedule, due, exc)
            return keep
        return max(keep, _CLAIM_PERIODS * gap) if math.isfinite(gap) else keep

    def _log_claim(self, entry: ScheduleEntry, won: bool, winner: str, run: str) -> None:
        if won:
            logger.info("leases: beat claimed %s (%s)", entry.name, run)
        elif winner.startswith(SKIPPED_BY):
            logger.info("leases: beat skips %s (%s): skipped after an outage", entry.name, run)
        elif winner:
            logger.info("leases: beat skips %s (%s): sent by %s", entry.name, run, winner)
        else:  # older than the last claimed run: who sent this one is no longer recorded
            logger.info("leases: beat skips %s (%s): a later run is claimed", entry.name, run)

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
