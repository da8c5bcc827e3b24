"""OpenTelemetry spans for celery_leases (optional: ``pip install celery-leases[otel]``).

Install them once per process that holds leases, next to ``Leases(app)`` (a prefork child
inherits what its parent installed before the fork)::

    from celery_leases import Leases, otel

    leases = Leases(app)
    otel.install()                             # the global TracerProvider
    otel.install(tracer_provider=provider)     # or another one

Spans (all ``INTERNAL``; attributes under ``celery_leases.``, the task's under ``celery.``):

- ``celery_leases.acquire``: one per resource of an acquire, from its start to its grant or
  its give-up: ``resource``, ``mode``, ``outcome`` (``granted`` or ``busy``), ``wait_seconds``
  (waiting included), ``ttl``, and ``celery.task_id`` / ``celery.task_name`` in a task.
- ``celery_leases.hold``: a held lease, from its grant to its release or its loss:
  ``resource``, ``outcome`` (``released`` or ``lost``; a lost one has an error
  status), ``held_seconds``, the task's attributes.
- ``celery_leases.release``: the release of one lease, its round trip included.
- ``celery_leases.renew``: one heartbeat renewal call: ``leases`` (how many it renewed),
  ``outcome`` (``ok`` or ``failed``, with an error status).
- ``celery_leases.cleanup``: a worker cleanup pass (``kind``: startup, reaper, reconcile,
  shutdown), ended when the pass reports: ``owners``, ``released``, ``expired``, ``errors``.
  A reaper or reconcile pass that did nothing makes none.

The spans are made from the signals of :mod:`celery_leases.signals` and the heartbeat's and
worker's observer hooks, with their measured start times, in the thread that sends them (a
span's parent is what is current there, e.g. a Celery task's span). Importing this module
imports nothing of OpenTelemetry; :func:`install` does. Until it is called no receiver is
connected, so a process without it pays nothing.

.. versionadded:: 0.1
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

from celery._state import get_current_task
from celery.utils.log import get_logger

from . import signals
from ._renewround import renew_observers
from .worker import cleanup_observers

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

    from ._cleanup import CleanupReport

__all__ = ("LeaseTracing", "install", "uninstall")

logger = get_logger(__name__)

#: leases remembered as lost, so that their later release ends no second hold span
MAX_LOST: Final = 10_000
#: cleanup passes that run on a timer: traced only when they did something
_PERIODIC: Final = frozenset({"reaper", "reconcile"})
_SIGNALS: Final = ("lease_acquired", "lease_busy", "lease_released", "lease_lost")

_installed: LeaseTracing | None = None
_lock = threading.Lock()


def _tracer(provider: TracerProvider | None) -> Tracer:
    try:
        from opentelemetry import trace
    except ImportError as exc:
        msg = (
            "celery_leases.otel needs opentelemetry-api; "
            "install it with: pip install celery-leases[otel]"
        )
        raise ImportError(msg, name="opentelemetry") from exc
    from . import __version__

    return trace.get_tracer("celery_leases", __version__, tracer_provider=provider)


def install(*, tracer_provider: TracerProvider | None = None) -> LeaseTracing:
    """Start making celery_leases spans (once per process; again: the same object).

    Args:
        tracer_provider: where the spans go (default: OpenTelemetry's global provider).

    Returns:
        the installed tracing (``uninstall()`` stops it).

    Raises:
        ImportError: ``opentelemetry-api`` is not installed (``pip install
            celery-leases[otel]``).

    .. versionadded:: 0.1
    """
    global _installed
    with _lock:
        if _installed is None:
            _installed = LeaseTracing(_tracer(tracer_provider))
            _installed._connect()
        return _installed


def uninstall() -> None:
    """Stop making spans (idempotent)."""
    global _installed
    with _lock:
        if _installed is not None:
            _installed._disconnect()
            _installed = None


def _ns(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)


class LeaseTracing:
    """The signal receivers and observers that make the spans; made by :func:`install`.

    .. versionadded:: 0.1
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        # (resource, token) of leases whose hold span ended as lost, oldest first
        self._lost: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._lost_lock = threading.Lock()
        self._receivers = {
            "lease_acquired": self.on_lease_acquired,
            "lease_busy": self.on_lease_busy,
            "lease_released": self.on_lease_released,
            "lease_lost": self.on_lease_lost,
        }

    def __repr__(self) -> str:
        return "<LeaseTracing>"

    def _connect(self) -> None:
        for name in _SIGNALS:
            getattr(signals, name).connect(
                self._receivers[name], weak=False, dispatch_uid=f"celery_leases.otel.{name}"
            )
        renew_observers.append(self.observe_renew)
        cleanup_observers.append(self.observe_cleanup)

    def _disconnect(self) -> None:
        for name in _SIGNALS:
            getattr(signals, name).disconnect(dispatch_uid=f"celery_leases.otel.{name}")
        renew_observers.remove(self.observe_renew)
        cleanup_observers.remove(self.observe_cleanup)

    # --- making spans ---------------------------------------------------------------------
    def _span(
        self,
        name: str,
        seconds: float | None,
        attributes: dict[str, Any],
        *,
        error: str | None = None,
    ) -> None:
        """A span that ended now and lasted ``seconds``."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = time.time_ns()
        span = self.tracer.start_span(
            name,
            kind=SpanKind.INTERNAL,
            attributes={k: v for k, v in attributes.items() if v is not None},
            start_time=end - _ns(seconds),
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)

    @staticmethod
    def _task(task_id: str | None) -> dict[str, Any]:
        if task_id is None:
            return {}
        task = get_current_task()
        name = getattr(task, "name", None) if task is not None else None
        return {"celery.task_id": task_id, "celery.task_name": name}

    # --- signal receivers (they never raise: a span is not worth a failed acquire) ----------
    def on_lease_acquired(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_acquired``: an acquire span, outcome granted."""
        try:
            attributes = {
                "celery_leases.resource": kwargs["resource"],
                "celery_leases.mode": "shared" if kwargs.get("shared") else "exclusive",
                "celery_leases.outcome": "granted",
                "celery_leases.wait_seconds": kwargs.get("elapsed"),
                "celery_leases.ttl": kwargs.get("ttl"),
                **self._task(kwargs.get("task_id")),
            }
            self._span("celery_leases.acquire", kwargs.get("elapsed"), attributes)
        except Exception:
            logger.exception("leases: could not trace an acquire")

    def on_lease_busy(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_busy``: an acquire span, outcome busy (not an error: a policy decides)."""
        try:
            attributes = {
                "celery_leases.resource": kwargs["resource"],
                "celery_leases.mode": "shared" if kwargs.get("shared") else "exclusive",
                "celery_leases.outcome": "busy",
                "celery_leases.wait_seconds": kwargs.get("elapsed"),
                "celery_leases.ttl": kwargs.get("ttl"),
                "celery_leases.retry_after": kwargs.get("retry_after"),
                **self._task(kwargs.get("task_id")),
            }
            self._span("celery_leases.acquire", kwargs.get("elapsed"), attributes)
        except Exception:
            logger.exception("leases: could not trace a busy acquire")

    def on_lease_released(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_released``: the release span, and the hold span unless it ended lost."""
        try:
            resource, task = kwargs["resource"], self._task(kwargs.get("task_id"))
            held_for = kwargs.get("held_for")
            self._span(
                "celery_leases.release",
                kwargs.get("elapsed"),
                {
                    "celery_leases.resource": resource,
                    "celery_leases.held_seconds": held_for,
                    **task,
                },
            )
            key = (resource, kwargs["token"])
            with self._lost_lock:
                was_lost = key in self._lost
                if was_lost:
                    del self._lost[key]
            if not was_lost:
                self._hold_span(resource, held_for, "released", task)
        except Exception:
            logger.exception("leases: could not trace a release")

    def on_lease_lost(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_lost``: the hold span ends, outcome lost (an error)."""
        try:
            resource = kwargs["resource"]
            with self._lost_lock:
                self._lost[(resource, kwargs["token"])] = None
                while len(self._lost) > MAX_LOST:
                    self._lost.popitem(last=False)
            # lost in the heartbeat thread: the task is not current there, its id is known
            task = {"celery.task_id": kwargs.get("task_id")}
            self._hold_span(resource, kwargs.get("held_for"), "lost", task)
        except Exception:
            logger.exception("leases: could not trace a lost lease")

    def _hold_span(
        self, resource: str, held_for: float | None, outcome: str, task: dict[str, Any]
    ) -> None:
        self._span(
            "celery_leases.hold",
            held_for,
            {
                "celery_leases.resource": resource,
                "celery_leases.outcome": outcome,
                "celery_leases.held_seconds": held_for,
                **task,
            },
            error="the lease was lost while held" if outcome == "lost" else None,
        )

    # --- hooks ----------------------------------------------------------------------------
    def observe_renew(self, seconds: float, ok: bool, count: int) -> None:
        """Heartbeat hook: one renewal call of ``count`` leases took ``seconds``."""
        self._span(
            "celery_leases.renew",
            seconds,
            {"celery_leases.leases": count, "celery_leases.outcome": "ok" if ok else "failed"},
            error=None if ok else "the renewal call failed",
        )

    def observe_cleanup(self, kind: str, report: CleanupReport) -> None:
        """Worker hook: a cleanup pass of ``kind`` reported.

        A periodic pass (reaper, reconcile) that did nothing makes no span: the reaper runs
        every ttl / 3 in every worker, and its empty passes were only noise.
        """
        if kind in _PERIODIC and not _did_something(report):
            return
        self._span(
            "celery_leases.cleanup",
            0.0,
            {
                "celery_leases.kind": kind,
                "celery_leases.owners": len(report.owners),
                "celery_leases.released": len(report.released),
                "celery_leases.expired": report.expired,
                "celery_leases.errors": len(report.errors),
            },
            error=f"{len(report.errors)} owner(s) could not be cleaned" if report.errors else None,
        )


def _did_something(report: CleanupReport) -> bool:
    """True if a cleanup pass looked at an owner, freed, dropped, kept or failed anything."""
    return bool(report.owners or report.released or report.expired or report.kept or report.errors)
