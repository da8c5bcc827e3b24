"""Per-entry beat policies (docs/beat.md): the overlap policy's run marker, the catch-up."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from celery import signals as celery_signals
from celery.beat import ScheduleEntry
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from celery.utils.log import get_logger
from kombu.utils.uuid import uuid

from ._claims import ClaimHolder
from ._lease import Lease, Want
from ._modes import header
from ._sync.heartbeat import heartbeat
from ._unique import _REDELIVERY_SLACK
from .exceptions import LeaseBusy, LeaseConfigError, LeaseError

if TYPE_CHECKING:
    from .app import Leases

__all__ = (
    "BUFFER_POLL",
    "CATCHUP_OPTION",
    "OVERLAP_OPTION",
    "RUN_HEADER",
    "EntryPolicy",
    "RunGate",
    "check_entries",
    "check_kept",
    "claim_run",
    "confirm_run",
    "cron_after",
    "cron_latest",
    "entry_policy",
    "install",
    "run_key",
    "send_options",
    "unclaim_run",
)

logger = get_logger(__name__)

Overlap = Literal["allow", "skip", "buffer_one"]
OVERLAP_OPTION: Final = "leases_overlap"
CATCHUP_OPTION: Final = "leases_catchup_window"
#: the entry options of this module, stripped before a run is published
OPTIONS: Final = (OVERLAP_OPTION, CATCHUP_OPTION)
#: message header naming the run marker a run takes over when it starts
RUN_HEADER: Final = "leases_beat_run"
#: the unique key of an entry's run marker is this, then the entry's name
_RUN_KEY_PREFIX: Final = "celery_leases:beat:run:"


@dataclass(frozen=True)
class EntryPolicy:
    """An entry's overlap policy and catch-up window (None: no catch-up run)."""

    overlap: Overlap = "allow"
    catchup_window: float | None = None


def entry_policy(name: str, options: Mapping[str, Any] | None) -> EntryPolicy:
    """The policies in beat entry ``name``'s ``options``, checked.

    Raises:
        LeaseConfigError: an unknown overlap policy, or a catch-up window that is not a
            finite number of seconds >= 0; the message names the entry.
    """
    options = options or {}
    overlap = options.get(OVERLAP_OPTION, "allow")
    if overlap not in get_args(Overlap):
        choices = ", ".join(repr(c) for c in get_args(Overlap))
        msg = f"beat entry {name!r}: {OVERLAP_OPTION}={overlap!r} is not one of {choices}"
        raise LeaseConfigError(msg)
    window = options.get(CATCHUP_OPTION)
    if window is not None:
        ok = isinstance(window, (int, float)) and not isinstance(window, bool)
        if not ok or not math.isfinite(window) or window < 0:
            msg = (
                f"beat entry {name!r}: {CATCHUP_OPTION}={window!r} must be a number of "
                "seconds >= 0 (or None: no catch-up run after an outage)"
            )
            raise LeaseConfigError(msg)
        window = float(window)
    return EntryPolicy(overlap, window)


def check_entries(schedule: Mapping[str, Any], mode: str) -> None:
    """Check the policies of every entry of a ``beat_schedule`` (beat start-up).

    Raises:
        LeaseConfigError: naming the entry: an invalid option, or a catch-up window where it
            cannot apply (leader mode; a schedule that is neither an interval nor a crontab).
    """
    for name, fields in schedule.items():
        options = fields.get("options") if isinstance(fields, Mapping) else None
        policy = entry_policy(str(name), options)
        if policy.catchup_window is None:
            continue
        when = fields.get("schedule")
        if mode != "claim":
            msg = f"beat entry {name!r}: {CATCHUP_OPTION} needs beat_mode='claim', not {mode!r}"
            raise LeaseConfigError(msg)
        kinds = (int, float, timedelta, crontab, interval_schedule)
        if not isinstance(when, kinds) or isinstance(when, bool):
            msg = (
                f"beat entry {name!r}: {CATCHUP_OPTION} applies to interval and crontab "
                f"schedules only, not {when!r}"
            )
            raise LeaseConfigError(msg)


def check_kept(configured: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Check that the scheduler kept the lease options of each configured entry.

    Raises:
        LeaseConfigError: a scheduler that keeps only options of its own
            (django-celery-beat's fields) dropped them; the message names the entry.
    """
    for name, fields in configured.items():
        options = fields.get("options") if isinstance(fields, Mapping) else None
        wanted = {k: v for k, v in (options or {}).items() if k in OPTIONS}
        entry = loaded.get(name)
        if not wanted or entry is None:
            continue
        kept = getattr(entry, "options", None) or {}
        if any(kept.get(k) != v for k, v in wanted.items()):
            msg = (
                f"beat entry {name!r}: this scheduler does not keep the options "
                f"{sorted(wanted)} (it keeps only options of its own); they cannot apply"
            )
            raise LeaseConfigError(msg)


def send_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` without this module's: what is passed on to ``apply_async``."""
    return {k: v for k, v in (options or {}).items() if k not in OPTIONS}


def run_key(entry: str) -> str:
    """The unique key of beat entry ``entry``'s run marker."""
    return f"{_RUN_KEY_PREFIX}{entry}"


# --- catch-up: the runs of a crontab --------------------------------------------------------
#: at most this many runs of a crontab are stepped through to find the latest missed one
_MAX_STEPS: Final = 100_000


def cron_after(schedule: crontab, when: datetime) -> datetime | None:
    """The crontab's first run after ``when`` (None: it has none)."""
    try:
        start, delta, _ = schedule.remaining_delta(when)
    except (ValueError, OverflowError):
        return None
    after: datetime = start + delta
    return after


def cron_latest(schedule: crontab, due: datetime, now_ms: int) -> datetime:
    """The latest run of the crontab, from ``due`` on, due at or before ``now_ms``."""
    latest = due
    for _ in range(_MAX_STEPS):
        after = cron_after(schedule, latest)
        if after is None or after.timestamp() * 1000 > now_ms:
            break
        latest = after
    return latest


# --- beat: the producer ---------------------------------------------------------------------
def claim_run(ext: Leases, entry: str, task_id: str) -> int | ClaimHolder:
    """Claim ``entry``'s run marker, pending, for run ``task_id`` about to be published.

    Returns the claim's token (confirm it with :func:`confirm_run` once the run is published,
    give it back with :func:`unclaim_run` if it is not), or the :class:`ClaimHolder` of the
    run still queued or running.
    """
    settings = ext.settings
    window = settings.unique_ttl  # unique_confirm off: the one call, no confirm
    if settings.unique_confirm:
        window = min(settings.unique_confirm_window, window)
    outcome = ext.store.unique_claim(run_key(entry), task_id, window)
    if isinstance(outcome, ClaimHolder):
        return outcome
    return outcome.token


def confirm_run(ext: Leases, entry: str, task_id: str, token: int) -> None:
    """Run ``task_id`` is published: its marker now lives ``unique_ttl`` while it is queued
    (with ``unique_confirm`` off it did from its claim: nothing to do)."""
    if not ext.settings.unique_confirm:
        return
    try:
        ext.store.unique_confirm(run_key(entry), task_id, token, ext.settings.unique_ttl)
    except LeaseError as exc:
        logger.error(
            "leases: beat sent %s[%s] but could not confirm its run marker; it lapses "
            "within unique_confirm_window: %s",
            entry,
            task_id,
            exc,
        )


def unclaim_run(ext: Leases, entry: str, task_id: str, token: int) -> None:
    """The publish of run ``task_id`` failed: give its marker back."""
    try:
        ext.store.unique_unclaim(run_key(entry), task_id, token)
    except LeaseError as exc:
        logger.error("leases: could not give back the run marker of %s: %s", entry, exc)


#: a buffered run is tried again this often (seconds) while its entry's marker is held
BUFFER_POLL: Final = 1.0
#: the resource of the lease of the one run buffered for an entry, then the entry's name
_BUFFER_PREFIX: Final = "celery_leases:beat:buffer:"

Publish = Callable[[ScheduleEntry], Any]


class RunGate:
    """One beat replica's overlap policies: sends a run only when its entry's marker is free.

    With ``buffer_one``, a run held back is kept (at most one per entry, fleet-wide: the
    replica that keeps it holds the entry's buffer lease) and sent by :meth:`poll` as soon
    as the marker is free.
    """

    def __init__(self) -> None:
        self._buffered: dict[str, tuple[ScheduleEntry, Publish, Lease]] = {}

    def send(
        self, ext: Leases, entry: ScheduleEntry, publish: Publish, buffer: Lease | None = None
    ) -> Any:
        """Publish ``entry``'s run through ``publish`` unless its policy holds it back.

        ``buffer``: the run is the buffered one, and this is its buffer lease (kept while the
        run stays held back).

        Returns what ``publish`` returned, or None when the run was not sent.
        """
        name = str(entry.name or entry.task)
        try:
            policy = entry_policy(name, entry.options)
        except LeaseConfigError as exc:
            logger.error("leases: beat does not send %s: %s", name, exc)
            return None
        options = entry.options
        sent = send_options(options)
        token: int | None = None
        if policy.overlap != "allow":
            if name in self._buffered:
                logger.info("leases: beat skips %s: a run is already buffered", name)
                return None
            task_id = str(sent.get("task_id") or uuid())
            try:
                got = claim_run(ext, name, task_id)
            except LeaseError as exc:
                logger.error("leases: beat could not claim the run marker of %s: %s", name, exc)
                return None
            if isinstance(got, ClaimHolder):
                if buffer is not None:
                    self._buffered[name] = (entry, publish, buffer)
                else:
                    self._held_back(ext, name, entry, publish, policy, got)
                return None
            token = got
            sent["task_id"] = task_id
            sent["headers"] = {**(sent.get("headers") or {}), RUN_HEADER: run_key(name)}
        entry.options = sent  # what Celery sees; put back below
        try:
            result = publish(entry)
        except BaseException:
            if token is not None:
                unclaim_run(ext, name, str(sent["task_id"]), token)
            raise
        finally:
            entry.options = options
        if token is not None:
            confirm_run(ext, name, str(sent["task_id"]), token)
        return result

    def _held_back(
        self,
        ext: Leases,
        name: str,
        entry: ScheduleEntry,
        publish: Publish,
        policy: EntryPolicy,
        holder: ClaimHolder,
    ) -> None:
        running = f"{holder.state} task {holder.task_id or '(unknown)'}"
        if policy.overlap == "buffer_one":
            try:
                (lease,) = ext.acquire([Want(f"{_BUFFER_PREFIX}{name}")], wait=0)
            except LeaseBusy:
                lease = None  # another replica keeps the one buffered run
            except LeaseError as exc:
                logger.error("leases: beat could not buffer a run of %s: %s", name, exc)
                lease = None
            if lease is not None:
                self._buffered[name] = (entry, publish, lease)
                logger.info("leases: beat buffers %s: its previous run (%s) runs", name, running)
                return
        logger.info("leases: beat skips %s: its previous run (%s) runs", name, running)

    def poll(self, ext: Leases) -> bool:
        """Send each buffered run whose marker is free; True while any run stays buffered."""
        for name, (entry, publish, lease) in list(self._buffered.items()):
            if lease.lost:  # its buffer lease ran out: it is no longer the one buffered run
                del self._buffered[name]
                logger.warning("leases: beat dropped the buffered run of %s: lease lost", name)
                continue
            del self._buffered[name]
            try:
                self.send(ext, entry, publish, lease)
            except Exception:
                logger.exception("leases: beat could not send the buffered run of %s", name)
            if name in self._buffered:  # still held back: the buffer lease is kept
                continue
            ext.release([lease])
        return bool(self._buffered)


# --- the worker: the run takes the marker over, and gives it back -------------------------
#: task id -> the run marker this process holds for it
_held: dict[str, Lease] = {}
_held_lock = threading.Lock()


def on_task_prerun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    """Pool process: a run sent with a marker takes it over before its body runs."""
    try:
        request = getattr(task, "request", None)
        key = header(request, RUN_HEADER) if request is not None else None
        if not isinstance(key, str) or not key or not task_id:
            return
        from .app import find_leases, ttl_of  # app.py imports worker.py, which imports this

        ext = find_leases(getattr(task, "app", None))
        if ext is None:
            return
        ttl = ttl_of(ext, None)
        outcome = ext.store.unique_take(key, task_id, ext.identity(), ttl, ttl + _REDELIVERY_SLACK)
        if isinstance(outcome, ClaimHolder):
            # its queued marker lapsed (it waited longer than unique_ttl) and another run
            # took it: this run is not stopped (a plain task cannot be, from here)
            logger.warning(
                "leases: beat run %s[%s] runs without its run marker %r (held by %s task %s)",
                getattr(task, "name", "?"),
                task_id,
                key,
                outcome.state,
                outcome.task_id or "(unknown)",
            )
            return
        heartbeat().add(outcome, ext.store)
        with _held_lock:
            _held[task_id] = Lease(outcome.resource, outcome.token, outcome.ttl, False, outcome)
        logger.info("leases: beat run %s[%s] holds its run marker", task.name, task_id)
    except Exception:
        logger.exception("leases: task_prerun handler (beat run marker) failed")


def on_task_postrun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    """Pool process: the run ended (however); give its marker back."""
    try:
        with _held_lock:
            lease = _held.pop(task_id or "", None)
        if lease is None:
            return
        from .app import find_leases

        ext = find_leases(getattr(task, "app", None))
        if ext is not None:
            ext.release([lease])
    except Exception:
        logger.exception("leases: task_postrun handler (beat run marker) failed")


def on_task_revoked(request: Any = None, terminated: bool = False, **kwargs: Any) -> None:
    """Worker: a run discarded before it started (revoked, expired) gives its marker back."""
    try:
        key = header(request, RUN_HEADER) if request is not None else None
        task_id = getattr(request, "id", None)
        if terminated or not isinstance(key, str) or not key or not isinstance(task_id, str):
            return
        from .app import find_leases

        ext = find_leases(getattr(kwargs.get("sender"), "app", None))
        if ext is not None and ext.store.unique_unclaim(key, task_id):
            logger.info("leases: revoked beat run %s gave back its run marker", task_id)
    except Exception:
        logger.exception("leases: task_revoked handler (beat run marker) failed")


def install() -> None:
    """Connect the worker's handlers of run markers (idempotent)."""
    handlers = {
        "task_prerun": on_task_prerun,
        "task_postrun": on_task_postrun,
        "task_revoked": on_task_revoked,
    }
    for name, handler in handlers.items():
        getattr(celery_signals, name).connect(
            handler, weak=False, dispatch_uid=f"celery_leases.beat_run.{name}"
        )
