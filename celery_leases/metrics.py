"""Prometheus metrics for celery_leases (optional: ``pip install celery-leases[metrics]``).

Install them once per process that holds leases, next to ``Leases(app)``::

    from celery import Celery
    from celery_leases import Leases
    from celery_leases import metrics

    app = Celery("proj")
    leases = Leases(app)
    metrics.install()        # the default registry; install(registry) for another one

Importing this module does not need ``prometheus_client``; :func:`install` does. The metrics
are fed by the signals of :mod:`celery_leases.signals` and by hooks of the heartbeat and the
worker's cleanup passes; see ``docs/metrics.md`` for each metric and for exposing them from a
prefork worker (``PROMETHEUS_MULTIPROC_DIR``).

.. versionadded:: 0.1
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from celery._state import get_current_task
from celery.utils.log import get_logger

from . import signals
from ._keys import pid_of_owner
from ._parking import parked_observers
from ._renewround import renew_observers
from .beat import clock_observers
from .worker import cleanup_observers

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from ._cleanup import CleanupReport

__all__ = ("LeaseMetrics", "install")

logger = get_logger(__name__)

#: acquire latency buckets in seconds; an acquire includes its wait for a busy resource
ACQUIRE_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, float("inf"),
)  # fmt: skip
#: renew call latency buckets in seconds; a renew call is one round trip to Redis
RENEW_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"),
)  # fmt: skip
#: the ``kind`` label values of ``cleanup_released_total``
CLEANUP_KINDS: Final = ("startup", "reaper", "reconcile", "shutdown")
#: leases tracked at most per process for ``leases_held`` (a bound against leaks: a lease
#: whose release failed on a Redis error is never reported released)
MAX_TRACKED: Final = 100_000

_SIGNALS: Final = (
    "lease_acquired",
    "lease_busy",
    "lease_released",
    "lease_lost",
    "redelivery_guarded",
    "limit_admitted",
    "limit_refused",
)
#: the ``outcome`` label values of ``redelivery_total``
REDELIVERY_OUTCOMES: Final = ("waiting", "dropped", "ran", "unguarded")

_installed: dict[int, LeaseMetrics] = {}
_installed_lock = threading.Lock()


def _prometheus() -> ModuleType:
    try:
        import prometheus_client
    except ImportError as exc:
        msg = (
            "celery_leases.metrics needs prometheus_client; "
            "install it with: pip install celery-leases[metrics]"
        )
        raise ImportError(msg, name="prometheus_client") from exc
    return prometheus_client


def install(
    registry: CollectorRegistry | None = None, *, namespace: str = "celery_leases"
) -> LeaseMetrics:
    """Create the celery_leases metrics in ``registry`` and start feeding them.

    Calling it again for the same registry returns the same :class:`LeaseMetrics`. Under a
    prefork pool, a child inherits what its parent installed before the fork.

    Args:
        registry: where to register the metrics (default: ``prometheus_client.REGISTRY``).
        namespace: the prefix of every metric name.

    Returns:
        the installed metrics.

    Raises:
        ImportError: ``prometheus_client`` is not installed (``pip install
            celery-leases[metrics]``).
        ValueError: the registry already has them under another namespace.

    .. versionadded:: 0.1
    """
    prometheus = _prometheus()
    if registry is None:
        registry = prometheus.REGISTRY
    with _installed_lock:
        # _installed keeps the registry alive, so its id cannot be reused meanwhile
        metrics = _installed.get(id(registry))
        if metrics is not None:
            if metrics.namespace != namespace:
                msg = (
                    f"celery_leases metrics are installed in this registry under namespace "
                    f"{metrics.namespace!r}, not {namespace!r}"
                )
                raise ValueError(msg)
            return metrics
        metrics = LeaseMetrics(prometheus, registry, namespace)
        metrics._connect()
        _installed[id(registry)] = metrics
        return metrics


class LeaseMetrics:
    """The celery_leases metrics of one registry; made by :func:`install`.

    Attributes:
        leases_held: Gauge (``mode``: exclusive|shared), leases this process holds.
        acquire_seconds: Histogram, seconds per acquired lease, waiting included.
        busy_total: Counter (``task``: task name or "-"), acquires refused as busy.
        renew_seconds: Histogram, seconds per heartbeat renew call (failed ones included).
        renew_failures_total: Counter, heartbeat renew calls that failed.
        lost_total: Counter, leases lost while held.
        cleanup_released_total: Counter (``kind``: startup|reaper|reconcile|shutdown), leases
            freed by the worker's cleanup passes.
        redelivery_total: Counter (``outcome``: waiting|dropped|ran|unguarded), deliveries
            of a task that met another copy of it, with the redelivery guard on.
        beat_clock_offset_seconds: Gauge, seconds the Redis clock is ahead of this beat
            replica's (negative: the replica's clock is ahead), measured at its last claim.

    .. versionadded:: 0.1
    """

    leases_held: Gauge
    acquire_seconds: Histogram
    busy_total: Counter
    renew_seconds: Histogram
    renew_failures_total: Counter
    lost_total: Counter
    cleanup_released_total: Counter
    redelivery_total: Counter
    beat_clock_offset_seconds: Gauge
    rate_admitted_total: Counter
    rate_limited_total: Counter

    def __init__(self, prometheus: ModuleType, registry: CollectorRegistry, namespace: str) -> None:
        self.registry = registry
        self.namespace = namespace
        common: dict[str, Any] = {"namespace": namespace, "registry": registry}
        self.leases_held = prometheus.Gauge(
            "leases_held",
            "Leases held by this process",
            ["mode"],
            multiprocess_mode="livesum",
            **common,
        )
        self.acquire_seconds = prometheus.Histogram(
            "acquire_seconds",
            "Seconds an acquire took, per acquired lease, waiting for a busy resource included",
            buckets=ACQUIRE_BUCKETS,
            **common,
        )
        self.busy_total = prometheus.Counter(
            "busy_total", "Acquires refused because a resource was busy", ["task"], **common
        )
        self.renew_seconds = prometheus.Histogram(
            "renew_seconds",
            "Seconds per heartbeat renew call (one per store and owner), failed calls included",
            buckets=RENEW_BUCKETS,
            **common,
        )
        self.renew_failures_total = prometheus.Counter(
            "renew_failures_total", "Heartbeat renew calls that failed", **common
        )
        self.lost_total = prometheus.Counter(
            "lost_total", "Leases lost while held (expired or taken over)", **common
        )
        self.cleanup_released_total = prometheus.Counter(
            "cleanup_released_total",
            "Leases still held that a worker cleanup pass released",
            ["kind"],
            **common,
        )
        self.redelivery_total = prometheus.Counter(
            "redelivery_total",
            "Deliveries that met another copy of their task (redelivery guard), by outcome",
            ["outcome"],
            **common,
        )
        self.parked_total = prometheus.Counter(
            "parked_total",
            "Tasks parked (on_busy='defer'), by task and lease template (never the rendered key)",
            ["task", "template"],
            **common,
        )
        self.beat_clock_offset_seconds = prometheus.Gauge(
            "beat_clock_offset_seconds",
            "Seconds the Redis clock is ahead of this beat replica's, at its last claim",
            multiprocess_mode="mostrecent",
            **common,
        )
        # labelled by the Rate's template ("-" for leases.limit), never by the rendered name:
        # 10,000 keys of one template are one series
        self.rate_admitted_total = prometheus.Counter(
            "rate_admitted_total", "Rate limit admissions", ["template"], **common
        )
        self.rate_limited_total = prometheus.Counter(
            "rate_limited_total", "Rate limit checks refused", ["template"], **common
        )
        # export every known series from the start, at 0
        for mode in ("exclusive", "shared"):
            self.leases_held.labels(mode)
        self.busy_total.labels("-")
        for kind in CLEANUP_KINDS:
            self.cleanup_released_total.labels(kind)
        for outcome in REDELIVERY_OUTCOMES:
            self.redelivery_total.labels(outcome)
        # (resource, token) -> mode of each lease acquired and neither released nor lost yet,
        # so a lease lost and then released is counted down once. Timeline: t0 acquired (+1);
        # t1 the heartbeat loses it, lease_lost (-1); t2 release() gives it back and still
        # sends lease_released (no change). The two may also come the other way round.
        self._held: dict[tuple[str, int], str] = {}
        self._held_lock = threading.Lock()
        self._pid = os.getpid()
        self._receivers = {
            "lease_acquired": self.on_lease_acquired,
            "lease_busy": self.on_lease_busy,
            "lease_released": self.on_lease_released,
            "lease_lost": self.on_lease_lost,
            "redelivery_guarded": self.on_redelivery_guarded,
            "limit_admitted": self.on_limit_admitted,
            "limit_refused": self.on_limit_refused,
        }

    def __repr__(self) -> str:
        return f"<LeaseMetrics namespace={self.namespace!r}>"

    # --- lifecycle ------------------------------------------------------------------------
    def _connect(self) -> None:
        for name in _SIGNALS:
            getattr(signals, name).connect(
                self._receivers[name], weak=False, dispatch_uid=self._uid(name)
            )
        renew_observers.append(self.observe_renew)
        cleanup_observers.append(self.observe_cleanup)
        clock_observers.append(self.observe_beat_clock)
        parked_observers.append(self.observe_parked)

    def _uid(self, name: str) -> str:
        return f"celery_leases.metrics.{id(self)}.{name}"

    def uninstall(self) -> None:
        """Stop feeding these metrics and remove them from their registry (idempotent)."""
        with _installed_lock:
            if _installed.get(id(self.registry)) is not self:
                return
            del _installed[id(self.registry)]
            for name in _SIGNALS:
                getattr(signals, name).disconnect(dispatch_uid=self._uid(name))
            renew_observers.remove(self.observe_renew)
            cleanup_observers.remove(self.observe_cleanup)
            clock_observers.remove(self.observe_beat_clock)
            parked_observers.remove(self.observe_parked)
            for collector in (
                self.leases_held,
                self.acquire_seconds,
                self.busy_total,
                self.renew_seconds,
                self.renew_failures_total,
                self.lost_total,
                self.cleanup_released_total,
                self.redelivery_total,
                self.parked_total,
                self.beat_clock_offset_seconds,
                self.rate_admitted_total,
                self.rate_limited_total,
            ):
                self.registry.unregister(collector)

    # --- leases_held bookkeeping ----------------------------------------------------------
    def _tracked(self) -> dict[tuple[str, int], str]:
        """The held-lease map of this process (a forked child starts with none)."""
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            self._held = {}
        return self._held

    def _hold(self, key: tuple[str, int], mode: str) -> None:
        with self._held_lock:
            held = self._tracked()
            if key in held:
                return
            if len(held) >= MAX_TRACKED:
                # forget the oldest; most likely a lease whose release never reached Redis
                old_key = next(iter(held))
                self.leases_held.labels(held.pop(old_key)).dec()
                logger.debug("leases: metrics stopped tracking %s", old_key[0])
            held[key] = mode
        self.leases_held.labels(mode).inc()

    def _drop(self, key: tuple[str, int]) -> None:
        with self._held_lock:
            mode = self._tracked().pop(key, None)
        if mode is not None:
            self.leases_held.labels(mode).dec()

    # --- signal receivers -----------------------------------------------------------------
    def on_lease_acquired(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_acquired``: one more lease held; observe the acquire latency."""
        try:
            mode = "shared" if kwargs.get("shared") else "exclusive"
            self._hold((kwargs["resource"], kwargs["token"]), mode)
            elapsed = kwargs.get("elapsed")
            if elapsed is not None:
                self.acquire_seconds.observe(elapsed)
        except Exception:
            logger.exception("leases: metrics could not count an acquire")

    def on_lease_busy(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_busy``: count it under the name of the task that asked (or "-")."""
        try:
            task = get_current_task() if kwargs.get("task_id") is not None else None
            name = getattr(task, "name", None) or "-"
            self.busy_total.labels(name).inc()
        except Exception:
            logger.exception("leases: metrics could not count a busy resource")

    def on_redelivery_guarded(self, sender: object = None, **kwargs: Any) -> None:
        """``redelivery_guarded``: count the outcome."""
        try:
            outcome = kwargs.get("outcome")
            if outcome in REDELIVERY_OUTCOMES:
                self.redelivery_total.labels(outcome).inc()
        except Exception:
            logger.exception("leases: metrics could not count a redelivery")

    def on_limit_admitted(self, sender: object = None, **kwargs: Any) -> None:
        """``limit_admitted``: count it under the Rate's template."""
        try:
            self.rate_admitted_total.labels(str(sender)).inc()
        except Exception:
            logger.exception("leases: metrics could not count a rate limit admission")

    def on_limit_refused(self, sender: object = None, **kwargs: Any) -> None:
        """``limit_refused``: count it under the Rate's template."""
        try:
            self.rate_limited_total.labels(str(sender)).inc()
        except Exception:
            logger.exception("leases: metrics could not count a rate limit refusal")

    def on_lease_released(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_released``: one lease fewer, unless it was counted down when lost."""
        try:
            self._drop((kwargs["resource"], kwargs["token"]))
        except Exception:
            logger.exception("leases: metrics could not count a release")

    def on_lease_lost(self, sender: object = None, **kwargs: Any) -> None:
        """``lease_lost``: count the loss; the lease is no longer held."""
        try:
            self.lost_total.inc()
            self._drop((kwargs["resource"], kwargs["token"]))
        except Exception:
            logger.exception("leases: metrics could not count a lost lease")

    # --- hooks ----------------------------------------------------------------------------
    def observe_renew(self, seconds: float, ok: bool, count: int) -> None:
        """Heartbeat hook: one renew call of ``count`` leases took ``seconds``."""
        self.renew_seconds.observe(seconds)
        if not ok:
            self.renew_failures_total.inc()

    def observe_cleanup(self, kind: str, report: CleanupReport) -> None:
        """Worker hook: a cleanup pass of ``kind`` is done.

        After the reaper freed the leases of dead pool children, their values leave the
        ``leases_held`` gauge in multiprocess mode: a child killed with SIGKILL never ran
        ``worker_process_shutdown`` to mark itself dead, so its gauge file would go on adding
        the leases it held to the sum.
        """
        self.cleanup_released_total.labels(kind).inc(len(report.released))
        if kind == "reaper":
            _mark_dead(report.owners)

    def observe_parked(self, task: str, template: str) -> None:
        """A task was parked (``_parking.parked_observers``)."""
        self.parked_total.labels(task, template).inc()

    def observe_beat_clock(self, replica: str, offset: float) -> None:
        """Beat hook: a claim of ``replica`` measured the Redis clock ``offset`` seconds ahead
        of the replica's."""
        self.beat_clock_offset_seconds.set(offset)


def _multiproc_dir() -> str | None:
    # prometheus_client reads either spelling (the lower-case one is deprecated)
    legacy = "prometheus_multiproc_dir"
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(legacy)


def _mark_dead(owners: list[str]) -> None:
    """Drop the multiprocess gauge files of the dead processes among ``owners``.

    The reaper only reports owners of this node's incarnation whose process it found gone:
    dead pool children. Race: t0 the reaper finds pid P dead; t1 the kernel gives P to a new
    process that opens a gauge file; t2 this drops that file. It needs the pid space to wrap
    between t0 and t2 (milliseconds), so it is left alone.
    """
    path = _multiproc_dir()
    if not path:
        return
    from prometheus_client import multiprocess

    for owner in owners:
        pid = pid_of_owner(owner)
        if pid is not None and pid != os.getpid():
            try:
                multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
            except OSError as exc:
                logger.warning("leases: metrics could not drop the files of pid %s: %s", pid, exc)
