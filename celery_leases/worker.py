"""The worker lifecycle: LeaseBootstep and the signal handlers that ``Leases(app)`` installs.

- At start-up, before the first task is consumed, the bootstep releases every lease that
  earlier incarnations of the same node name held (a pod restarted under the same name), in
  O(leases they held). A node with no past pays one command. Until the leases Redis answers,
  the worker waits there, consuming nothing.
- A reaper in the main process frees the leases of pool children that died without running
  their finalizers (SIGKILL, hard time limit, ``revoke(terminate=True, signal="SIGKILL")``): at
  once when Celery reports such an end, and every ``ttl / 3`` seconds otherwise.
- A periodic reconcile releases the leases of owners whose liveness ran out anywhere in the
  fleet (a node that never came back), one worker of the fleet at a time.
- Warm shutdown releases what the node still holds; cold shutdown leaves it to the next start.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from celery import bootsteps, signals
from celery.exceptions import WorkerShutdown, WorkerTerminate
from celery.utils.log import get_logger
from celery.worker import state as worker_state

from ._beat_runs import install as install_beat_runs
from ._cleanup import CleanupReport
from ._guard import GuardStep
from ._guard import on_task_postrun as guard_task_postrun
from ._identity import set_node
from ._keys import split_owner
from ._lease import Want
from ._parking import parking_used, publish_taken_over
from ._parking import pump as pump_parked
from ._text import printable
from .config import DEFAULT_REDIS_URL, renewal_interval, safe_url, timing_warnings
from .exceptions import LeaseBackendError, LeaseError

if TYPE_CHECKING:
    from .app import Leases

__all__ = ("LeaseBootstep", "install")

logger = get_logger(__name__)

#: the resource whose lease makes one worker of the fleet the one that reconciles
RECONCILE_RESOURCE: Final = "celery_leases:reconcile"
#: exceptions with which Celery's main process reports a child that ended without finalizers
_CHILD_DEATHS: Final = ("WorkerLostError", "TimeLimitExceeded", "Terminated")
#: delay before looking again for a child killed after a hard time limit (billiard sends
#: SIGTERM first and SIGKILL about 0.1 s later)
_REAP_AGAIN_AFTER: Final = 1.0
#: names of tasks whose child died that the main process keeps for the reaper's log lines
_NAMES_KEPT: Final = 256
#: start-up tries of an unreachable leases Redis: 0.5 s, doubling, at most 10 s apart
_STARTUP_RETRY_FIRST: Final = 0.5
_STARTUP_RETRY_MAX: Final = 10.0
#: how often a start-up wait looks for a shutdown request
_STARTUP_POLL: Final = 0.2

#: ``observer(kind, report)`` after a cleanup pass; kind is "startup", "reaper", "reconcile" or
#: "shutdown"
CleanupObserver = Callable[[str, CleanupReport], None]
#: called after every cleanup pass (celery_leases.metrics adds one); exceptions are logged.
#: An internal hook, not in __all__: not a public API.
cleanup_observers: Final[list[CleanupObserver]] = []

_active: LeaseBootstep | None = None


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _log_report(
    kind: str, what: str, report: CleanupReport, names: Mapping[str, str] | None = None
) -> None:
    """Tell the observers, and log what a cleanup pass freed, whose it was and whose task.

    ``names`` maps the task ids this process knows to their task names.
    """
    for observer in tuple(cleanup_observers):
        try:
            observer(kind, report)
        except Exception:
            logger.exception("leases: a cleanup observer failed")
    if report.released:
        logger.info(
            "leases: %s released %d lease(s): %s",
            what,
            len(report.released),
            ", ".join(sorted({printable(r) for _, r in report.released})),
        )
    # one line per owner and task: the owner whose leases these were, and the task holding them
    # (names escaped: a newline in a resource name must not forge a log line)
    by_holder: dict[tuple[str, str | None], list[str]] = {}
    for owner, freed in report.freed:
        by_holder.setdefault((owner, freed.task_id), []).append(freed.resource)
    whose = "owner" if kind == "shutdown" else "dead owner"
    for (owner, task_id), resources in sorted(
        by_holder.items(), key=lambda i: (i[0][0], i[0][1] or "")
    ):
        logger.info(
            "leases: %s freed %d lease(s) of %s %s, %s: %s",
            what,
            len(resources),
            whose,
            owner,
            _task_text(task_id, names),
            ", ".join(sorted(printable(r) for r in resources)),
        )
    for owner, entry in report.kept:
        logger.error("leases: %s kept an unreadable registry entry of %s: %r", what, owner, entry)
    for owner, error in report.errors:
        logger.error("leases: %s could not clean owner %s: %s", what, owner, error)


def _cleaned(
    ext: Leases,
    kind: str,
    what: str,
    report: CleanupReport,
    names: Mapping[str, str] | None = None,
) -> None:
    """After a cleanup pass: publish the parked tasks' hand-ons it took over from dead
    owners (see _parking.py), then tell the observers and log (:func:`_log_report`)."""
    if report.handons:
        publish_taken_over(ext, report)
    _log_report(kind, what, report, names)


def _task_text(task_id: str | None, names: Mapping[str, str] | None) -> str:
    if task_id is None:
        return "held outside a task"
    name = (names or {}).get(task_id)
    shown = printable(task_id)
    return f"task {shown} ({printable(name)})" if name else f"task {shown}"


def _note_redis_url(ext: Leases) -> None:
    """Warn at start-up when the leases Redis is localhost only because the broker is not Redis.

    Every worker of a fleet must share one leases Redis; a localhost default on each machine
    gives each its own, and no exclusion between them.
    """
    url = ext.settings.url
    broker = ext.app.conf.broker_url
    given = os.environ.get("CELERY_LEASES_REDIS_URL") or ext.app.conf.get("leases_redis_url")
    if given or url != DEFAULT_REDIS_URL:
        return
    if isinstance(broker, str) and broker.startswith(("redis://", "rediss://", "sentinel://")):
        return
    logger.warning(
        "leases: no redis_url is set and the broker (%s) is not Redis: leases use the default "
        "%s. Every worker of the fleet must use the same leases Redis; set leases_redis_url "
        "(or CELERY_LEASES_REDIS_URL) to name it.",
        safe_url(broker) if isinstance(broker, str) else "Celery's default, amqp",
        url,
    )


def _startup_cleanup(ext: Leases, node: str, incarnation: str) -> CleanupReport | None:
    """The start-up cleanup, tried until the leases Redis answers; None if it failed otherwise.

    ``LeaseBootstep.start`` runs before the consumer, so while this waits the worker takes no
    task off the queue and does not say "ready": a worker that cannot reach the leases Redis
    would otherwise take every leased task and fail or retry it. A warm or cold shutdown asked
    for meanwhile (Celery's signal handlers only set a flag) ends the wait.
    """
    attempt = 0
    while True:
        try:
            return ext.store.cleanup_node(node, keep_incarnation=incarnation)
        except LeaseBackendError as exc:
            delay = min(_STARTUP_RETRY_MAX, _STARTUP_RETRY_FIRST * 2**attempt)
            attempt += 1
            logger.warning(
                "leases: the leases Redis does not answer at start-up (attempt %d): %s; not "
                "consuming tasks until it does, next try in %.1fs",
                attempt,
                exc,
                delay,
            )
        except LeaseError as exc:
            logger.error("leases: start-up cleanup of node %s failed: %s", node, exc)
            return None
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            _raise_if_shutdown_asked()
            time.sleep(min(_STARTUP_POLL, max(0.0, deadline - time.monotonic())))
        _raise_if_shutdown_asked()


def _raise_if_shutdown_asked() -> None:
    # Celery's SIGTERM/SIGINT/SIGQUIT handlers set these flags; its WorkController.start
    # turns the exceptions into a warm or cold shutdown
    if worker_state.should_terminate is not None and worker_state.should_terminate is not False:
        raise WorkerTerminate(worker_state.should_terminate)
    if worker_state.should_stop is not None and worker_state.should_stop is not False:
        raise WorkerShutdown(worker_state.should_stop)


class LeaseBootstep(bootsteps.StartStopStep):
    """Worker bootstep: start-up cleanup, the dead-child reaper and the periodic reconcile.

    ``start`` runs in the worker's main process after the pool and before the consumer, so the
    start-up cleanup is done before any task is received.

    .. versionadded:: 0.1
    """

    label = "Leases"
    requires = ("celery.worker.components:Timer", "celery.worker.components:Pool")

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        from .app import find_leases  # app.py imports this module: imported here, not at the top

        ext = find_leases(worker.app)
        self.enabled = ext is not None
        self.ext: Leases | None = ext
        self.pid = os.getpid()
        self.worker = worker
        self._timers: list[Any] = []
        self._timer: Any = None  # the worker's timer, for an early turn of the pump
        self._early: Any = None  # that early turn, while one is pending
        self._lock = threading.Lock()
        # task id -> name of tasks that ended with their child's death, newest last
        self._names: dict[str, str] = {}
        if ext is not None and ext.settings.node is None:
            set_node(worker.hostname)
        if ext is not None:
            # task.py imports app.py, which imports this module: imported here, not at the top
            from .task import adopt

            # Tasks registered after finalize without Celery's task factory
            # (app.register_task) get LeasedTask's behaviour here: the steps are made after
            # the task modules are imported, before the pool forks (a child builds its
            # tracers from the classes it inherits) and before any task runs.
            for task in list(worker.app.tasks.values()):
                adopt(task)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self, worker: Any) -> None:
        global _active
        ext = self.ext
        if ext is None:
            return
        _active = self
        from .app import checked_settings  # app.py imports this module: not at the top

        # a leases_* key changed since the settings' first use is refused here, at start
        checked_settings(ext, full=True)
        # impossible timings were refused; risky ones are told once, at INFO: a short ttl
        # with the default socket_timeout is what tests and trials run, and it is safe
        for note in timing_warnings(ext.settings):
            logger.info("leases: timing: %s", note)
        _note_redis_url(ext)
        ident = ext.identity()
        report = _startup_cleanup(ext, ident.node, ident.incarnation)
        if report is not None:
            _cleaned(
                ext, "startup", f"start-up cleanup of earlier incarnations of {ident.node}", report
            )
        timer = getattr(worker, "timer", None)
        if timer is None:
            return
        reap_every = max(0.5, renewal_interval(ext.settings.ttl))
        self._timers.append(timer.call_repeatedly(reap_every, self.reap, priority=10))
        if ext.settings.reconcile_interval > 0:
            self._timers.append(
                timer.call_repeatedly(ext.settings.reconcile_interval, self.reconcile, priority=10)
            )
        if parking_used(worker.app):
            # on_busy="defer": hand on what a holder that died (or a lost hand-on) left parked,
            # and what a rate limit's window has room for again
            self._timer = timer
            self._timers.append(
                timer.call_repeatedly(ext.settings.park_pump_interval, self.pump, priority=10)
            )

    def stop(self, worker: Any) -> None:
        self._timer = None
        if self._early is not None:
            self._timers.append(self._early)
            self._early = None
        for tref in self._timers:
            try:
                tref.cancel()
            except Exception:
                logger.debug("leases: could not cancel a timer", exc_info=True)
        self._timers = []
        # _active stays set: Celery sends worker_shutdown after the steps stopped, and the
        # final release needs this step (on_worker_shutdown clears it)

    def terminate(self, worker: Any) -> None:
        """Cold shutdown: stop the timers; what the node holds is left to the next start."""
        self.stop(worker)

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)

    # --- periodic work ------------------------------------------------------------------
    def pump(self) -> int:
        """One turn of the parked tasks' pump (see _parking.py); never raises."""
        ext = self.ext
        if ext is None:
            return 0
        soonest: list[float] = []
        try:
            count = pump_parked(ext, soonest)
        except Exception:
            logger.exception("leases: the parking pump failed")
            return 0
        timer = self._timer
        if soonest and timer is not None and self._early is None:
            # a rate limit has room again before the next turn: one turn more, then
            wait = min(soonest)
            if wait < ext.settings.park_pump_interval:
                self._early = timer.call_after(wait, self._early_pump, priority=10)
        return count

    def _early_pump(self) -> None:
        self._early = None
        self.pump()

    def reap(self) -> CleanupReport:
        """Free the leases of this incarnation's processes that are gone (dead children)."""
        if os.getpid() != self.pid:
            return CleanupReport()

        def dead(pid: int) -> bool:
            return pid != self.pid and not _pid_alive(pid)

        self.mark_alive()
        return self._clean_own("reaper", "reaper (dead pool process)", dead, spare_newer=True)

    def mark_alive(self) -> None:
        """Refresh this node's mark of life (``celery leases health --node``), every reaper
        pass: a node whose processes hold no lease renews no liveness, yet it is alive."""
        ext = self.ext
        if ext is None:
            return
        try:
            ident = ext.identity()
            ext.store.mark_node_alive(ident.node, ident.incarnation)
        except LeaseError as exc:
            logger.debug("leases: could not mark the node alive: %s", exc)

    def _clean_own(
        self,
        kind: str,
        what: str,
        select: Callable[[int], bool],
        *,
        spare_newer: bool = False,
    ) -> CleanupReport:
        """Clean the owners of this node's current incarnation whose pid ``select`` picks.

        With ``spare_newer``, only leases granted before ``select`` looked are freed. A pid
        can be reused: t0 ``select`` finds pid P dead; t1 a new pool process gets P, hence
        the same owner id, and takes a lease; t2 the cleanup of that owner must not free it.
        Its token is at least the Redis clock of its grant, so reading the clock before t0
        and freeing only older tokens spares it (and keeps the owner registered).
        """
        report = CleanupReport()
        ext = self.ext
        if ext is None:
            return report
        ident = ext.identity()
        with self._lock:
            try:
                # a microsecond less than the float of seconds may say: erring low only spares
                # a lease until the next pass
                before_us, offsets = ext.store.clocks_us() if spare_newer else (None, None)
                if before_us is not None:
                    before_us -= 1
                owners = ext.store.node_owners(ident.node)
            except LeaseError as exc:
                logger.error("leases: %s could not list owners: %s", what, exc)
                return report
            for owner in owners:
                _, incarnation, pid = split_owner(owner)
                if incarnation == ident.incarnation and pid.isdigit() and select(int(pid)):
                    report.merge(
                        ext.store.cleanup_owner_isolated(
                            owner,
                            dead=True,
                            granted_before_us=before_us,
                            clock_offsets_us=offsets,
                            by=kind,
                        )
                    )
        _cleaned(ext, kind, what, report, self._task_names(report))
        return report

    def note_task(self, task_id: str | None, name: str | None) -> None:
        """Remember the name of a task whose child may have died, for the reaper's log."""
        if task_id and name:
            names = self._names
            names.pop(task_id, None)
            names[task_id] = name
            while len(names) > _NAMES_KEPT:
                names.pop(next(iter(names)), None)

    def _task_names(self, report: CleanupReport) -> dict[str, str]:
        """The names this process knows of the tasks whose leases ``report`` freed.

        The registry records task ids only; the main process learnt the names of the tasks
        that ended with a dead child (``note_task``) or still tracks them as requests.
        """
        out: dict[str, str] = {}
        for _, entry in report.freed:
            task_id = entry.task_id
            if task_id is None or task_id in out:
                continue
            name = self._names.get(task_id)
            if name is None:
                request = worker_state.requests.get(task_id)
                name = getattr(request, "name", None)
            if isinstance(name, str):
                out[task_id] = name
        return out

    def reconcile(self) -> CleanupReport | None:
        """Release the leases of owners whose liveness ran out, if no other worker is at it.

        Returns None when another worker holds the reconcile lease.
        """
        ext = self.ext
        if ext is None or os.getpid() != self.pid:
            return None
        return run_reconcile(ext)

    def final_release(self) -> CleanupReport:
        """Release everything this incarnation of the node still holds (warm shutdown)."""
        node = self.ext.identity().node if self.ext is not None else ""
        return self._clean_own("shutdown", f"warm shutdown of {node}", lambda pid: True)

    def reap_soon(self) -> None:
        """Reap now, and once more shortly (a child may still be exiting)."""
        self.reap()
        timer = getattr(self.worker, "timer", None)
        if timer is not None:
            try:
                timer.call_after(_REAP_AGAIN_AFTER, self.reap)
            except Exception:
                logger.debug("leases: could not schedule a reaper run", exc_info=True)


def run_reconcile(ext: Leases) -> CleanupReport | None:
    """One orphan-reconcile pass under the fleet-wide reconcile lease.

    Returns the report, or None when another process holds the reconcile lease.
    """
    ident = ext.identity()
    ttl = max(60.0, ext.settings.reconcile_interval)
    try:
        got = ext.store.try_acquire([Want(RECONCILE_RESOURCE)], ident, ttl)
    except LeaseError as exc:
        logger.error("leases: reconcile could not start: %s", exc)
        return None
    if not isinstance(got, list):
        logger.debug("leases: another worker is reconciling")
        return None
    try:
        report = ext.store.reconcile()
        _cleaned(ext, "reconcile", "orphan reconcile", report)
        return report
    except LeaseError as exc:
        logger.error("leases: reconcile failed: %s", exc)
        return CleanupReport(errors=[("*", str(exc))])
    finally:
        try:
            ext.store.release(got)
        except LeaseError as exc:
            logger.error("leases: could not release the reconcile lease: %s", exc)


# --- signal handlers (connected by install) ---------------------------------------------
def on_task_failure(exception: BaseException | None = None, **kwargs: Any) -> None:
    """Main process: a child died or hit the hard time limit; free what it held."""
    try:
        step = _active
        if step is None or os.getpid() != step.pid:
            return
        if type(exception).__name__ in _CHILD_DEATHS:
            step.note_task(kwargs.get("task_id"), getattr(kwargs.get("sender"), "name", None))
            step.reap_soon()
    except Exception:
        logger.exception("leases: task_failure handler failed")


def on_task_revoked(terminated: bool = False, **kwargs: Any) -> None:
    """Main process: a task was terminated; its child may have died without finalizers."""
    try:
        step = _active
        if step is not None and terminated and os.getpid() == step.pid:
            request = kwargs.get("request")
            step.note_task(
                getattr(request, "id", None), getattr(kwargs.get("sender"), "name", None)
            )
            step.reap_soon()
    except Exception:
        logger.exception("leases: task_revoked handler failed")


def on_worker_before_create_process(**kwargs: Any) -> None:
    """Main process, prefork: a child is being (re)placed; the one it replaces may be dead."""
    try:
        step = _active
        if step is not None and os.getpid() == step.pid:
            step.reap()
    except Exception:
        logger.exception("leases: worker_before_create_process handler failed")


def on_worker_shutdown(**kwargs: Any) -> None:
    """Main process, warm shutdown only: give back what the node still holds."""
    global _active
    try:
        step = _active
        if step is not None and os.getpid() == step.pid:
            _active = None
            step.final_release()
    except Exception:
        logger.exception("leases: worker_shutdown handler failed")


_install_lock = threading.Lock()


def install(ext: Leases) -> None:
    """Add the bootstep to ``ext.app`` and connect the signal handlers (idempotent)."""
    with _install_lock:
        steps = ext.app.steps["worker"]
        if LeaseBootstep not in steps:
            steps.add(LeaseBootstep)
        # the redelivery guard: a consumer step that does nothing unless the setting is on
        consumer_steps = ext.app.steps["consumer"]
        if GuardStep not in consumer_steps:
            consumer_steps.add(GuardStep)
        handlers = {
            "task_failure": on_task_failure,
            "task_revoked": on_task_revoked,
            "worker_before_create_process": on_worker_before_create_process,
            "worker_shutdown": on_worker_shutdown,
            "task_postrun": guard_task_postrun,
        }
        for name, handler in handlers.items():
            getattr(signals, name).connect(
                handler, weak=False, dispatch_uid=f"celery_leases.{name}"
            )
        install_beat_runs()  # the run markers of beat entries with an overlap policy
