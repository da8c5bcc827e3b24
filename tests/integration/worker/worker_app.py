"""The Celery app that the worker integration tests run in real ``celery worker`` processes.

Configured from the environment so that each test gets its own queue, key prefix and TTL:
``LEASES_TEST_BROKER``, ``LEASES_TEST_BACKEND``, ``LEASES_TEST_QUEUE``, plus every
``CELERY_LEASES_*`` setting. Tasks record what they do in a ledger in Redis
(``{<prefix>:ledger}:...``), so a test can count overlaps and check fencing tokens.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from celery_leases import LeasedTask, LeaseLost, Leases, Shared, current_leases
from tests.support.perprocess import PerProcessClient

BROKER = os.environ.get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/15")
BACKEND = os.environ.get("LEASES_TEST_BACKEND", BROKER)
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "leases-tests")
PREFIX = os.environ.get("CELERY_LEASES_KEY_PREFIX", "leases-tests")
LEDGER_URL = os.environ.get("LEASES_TEST_LEDGER", BACKEND)

if os.environ.get("LEASES_TEST_CLOCK_OFFSET"):
    # a worker whose wall clock is off by that many seconds (time.time only)
    _real_time = time.time
    _clock_offset = float(os.environ["LEASES_TEST_CLOCK_OFFSET"])
    time.time = lambda: _real_time() + _clock_offset

app = Celery("worker_app", broker=BROKER, backend=BACKEND)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=600,
    worker_prefetch_multiplier=1,
)


@app.task(lease="res:{rid}")
def plain_early(rid: str) -> dict[str, Any]:
    """Declared before ``Leases(app)``, without ``base=LeasedTask``: it gets the lease too."""
    return _guarded(0)


leases = Leases(app)

if os.environ.get("LEASES_TEST_METRICS"):
    # prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set by the test)
    from celery_leases import metrics

    metrics.install()

#: a per-process client for the ledger (never the store under test)
ledger = PerProcessClient(LEDGER_URL)

if os.environ.get("LEASES_TEST_OTEL"):
    # OpenTelemetry spans, each written to the ledger as it ends (tests/integration/worker/
    # test_otel_worker.py); installed in the main process, so every pool child inherits it
    from tests.support.otel_ledger import install_ledger_spans

    install_ledger_spans(lambda: ledger(), f"{{{PREFIX}:ledger}}:spans")


def ledger_key(*parts: object) -> str:
    return f"{{{PREFIX}:ledger}}:" + ":".join(str(p) for p in parts)


def _enter(resource: str, token: int) -> None:
    r = ledger()
    now = r.incr(ledger_key("active", resource))
    pipe = r.pipeline(transaction=False)
    if now > 1:
        pipe.incr(ledger_key("overlaps"))
    pipe.rpush(ledger_key("tokens", resource), token)
    pipe.incr(ledger_key("runs"))
    pipe.execute()


def _leave(resource: str) -> None:
    ledger().decr(ledger_key("active", resource))


def _record(name: str, value: Any) -> None:
    ledger().rpush(ledger_key("events", name), str(value))


def _guarded(seconds: float) -> dict[str, Any]:
    held = current_leases()
    for lease in held:
        _enter(lease.resource, lease.token)
    try:
        if seconds:
            time.sleep(seconds)
    finally:
        for lease in held:
            _leave(lease.resource)
    return {
        "pid": os.getpid(),
        "leases": [[lease.resource, lease.token] for lease in held],
    }


@app.task(base=LeasedTask, lease="res:{rid}")
def guarded(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    """Hold res:<rid> for ``seconds`` (on_busy from the settings: retry by default)."""
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", on_busy="skip")
def busy_skip(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", on_busy="fail")
def busy_fail(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", on_busy="wait", wait_timeout=30)
def busy_wait(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", on_busy="retry", busy_timeout=3)
def busy_retry_short(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    return _guarded(seconds)


@app.task(base=LeasedTask, bind=True, lease="res:{rid}", max_retries=1)
def retry_in_body(self: Any, rid: str, countdown: float = 2.0) -> dict[str, Any]:
    """Retries itself once (the lease must be free during the countdown), then succeeds."""
    _record(f"retry_in_body:{rid}", f"{self.request.retries}:{time.time()}")
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return _guarded(0)


@app.task(base=LeasedTask, lease="res:{rid}")
def fails(rid: str) -> None:
    raise ValueError(f"failing on purpose for {rid}")


@app.task(base=LeasedTask, lease="res:{rid}", soft_time_limit=1, time_limit=20)
def soft_limited(rid: str) -> str:
    try:
        time.sleep(10)
    except SoftTimeLimitExceeded:
        _record(f"soft:{rid}", "caught")
        raise
    return "not reached"


@app.task(base=LeasedTask, lease="res:{rid}", time_limit=2)
def hard_limited(rid: str) -> str:
    time.sleep(30)
    return "not reached"


@app.task(base=LeasedTask, lease="res:{rid}")
def sleeper(rid: str, seconds: float = 30.0) -> dict[str, Any]:
    """Announce it runs (ledger event), then sleep: for revoke, kill -9 and restart tests."""
    _record(f"started:{rid}", os.getpid())
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", acks_late=True, reject_on_worker_lost=True)
def late(rid: str, seconds: float = 2.0) -> dict[str, Any]:
    _record(f"started:{rid}", os.getpid())
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="res:{rid}", on_lost="interrupt")
def interrupted(rid: str, seconds: float = 30.0) -> str:
    """Sleeps in small steps until LeaseLost arrives; reports what it caught."""
    _record(f"started:{rid}", os.getpid())
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(0.05)
    except LeaseLost as exc:
        _record(f"lost:{rid}", exc.resource)
        return f"lost:{exc.resource}"
    return "not interrupted"


@app.task(base=LeasedTask, lease="res:{rid}", on_lost="log")
def logged(rid: str, seconds: float = 5.0) -> str:
    _record(f"started:{rid}", os.getpid())
    time.sleep(seconds)
    return "finished"


@app.task(
    base=LeasedTask,
    leases=["multi:{a}", Shared("shared:{b}"), Shared("limited:{c}", limit=2)],
)
def multi(a: str, b: str, c: str = "x", seconds: float = 0.0) -> dict[str, Any]:
    if seconds:
        time.sleep(seconds)
    return {
        "pid": os.getpid(),
        "leases": [[lease.resource, lease.token, lease.shared] for lease in current_leases()],
    }


@app.task
def plain(x: int) -> int:
    return x


# --- restart/fault tests ---
@app.task(base=LeasedTask, lease="res:{rid}", lease_ttl=60)
def long_lease(rid: str, seconds: float = 30.0) -> dict[str, Any]:
    """Like ``sleeper`` but its lease lives 60 s, far longer than the node's liveness."""
    _record(f"started:{rid}", os.getpid())
    return _guarded(seconds)


@app.task(base=LeasedTask, lease="tiny:{rid}")
def leased_tiny(rid: str) -> str:
    """The leased counterpart of ``plain`` for the task-throughput benchmark."""
    return rid


def _trace_reconcile(pause: float) -> None:
    """Record every orphan-reconcile pass and every bid for the reconcile lease in the ledger.

    A pass bumps ``reconcile:active`` while it runs (and ``reconcile:overlaps`` when it finds
    another pass running) and stays open ``pause`` seconds after the real pass, so that two
    passes not kept apart would overlap. Only wraps the real store calls; Redis is real.
    """
    from celery_leases.worker import RECONCILE_RESOURCE

    store = leases.store
    real_reconcile, real_try_acquire = store.reconcile, store.try_acquire

    def node() -> str:
        return leases.identity().node

    def reconcile(limit: int = 1000) -> Any:
        r = ledger()
        if r.incr(ledger_key("reconcile", "active")) > 1:
            r.incr(ledger_key("reconcile", "overlaps"))
        try:
            r.rpush(ledger_key("reconcile", "passes"), node())
            report = real_reconcile(limit)
            time.sleep(pause)
            return report
        finally:
            r.decr(ledger_key("reconcile", "active"))

    def try_acquire(wants: Any, ident: Any, ttl: float, *args: Any) -> Any:
        outcome = real_try_acquire(wants, ident, ttl, *args)
        if [w.resource for w in wants] == [RECONCILE_RESOURCE]:
            won = "won" if isinstance(outcome, list) else "busy"
            ledger().rpush(ledger_key("reconcile", "bids"), f"{node()} {won}")
        return outcome

    store.reconcile = reconcile  # type: ignore[method-assign]
    store.try_acquire = try_acquire  # type: ignore[method-assign, assignment, unused-ignore]


if os.environ.get("LEASES_TEST_TRACE_RECONCILE"):
    _trace_reconcile(float(os.environ["LEASES_TEST_TRACE_RECONCILE"]))


# --- policies/endings tests ---
def _stamp(task: Any) -> dict[str, Any]:
    """What a bound leased task saw: when its body started, its own retries, its leases."""
    return {
        "pid": os.getpid(),
        "started": time.time(),
        "retries": task.request.retries,
        "leases": [[lease.resource, lease.token] for lease in current_leases()],
    }


@app.task(base=LeasedTask, bind=True, lease="res:{rid}", on_busy="wait", wait_timeout=30)
def wait_stamped(self: Any, rid: str) -> dict[str, Any]:
    """on_busy="wait"; reports when its body started."""
    return _stamp(self)


@app.task(base=LeasedTask, bind=True, lease="res:{rid}", on_busy="retry", max_retries=0)
def retry_no_budget(self: Any, rid: str) -> dict[str, Any]:
    """on_busy="retry" on a task allowed no retries of its own: busy retries must not count."""
    return _stamp(self)


@app.task(base=LeasedTask, leases=["p:{a}", Shared("k:{b}"), "d:{c}"])
def declared_order(a: str, b: str, c: str = "dflt") -> list[list[Any]]:
    """Reports current_leases(); the declared order is the reverse of the sorted one."""
    out = []
    for lease in current_leases():
        lease.check()
        out.append([lease.resource, lease.token, lease.shared, lease.expires_in, lease.ttl])
    return out


@app.task
def unleased_view() -> list[str]:
    """A plain task: it must see no leases, even in a process that ran leased tasks."""
    return [lease.resource for lease in current_leases()]


@app.task(base=LeasedTask, lease="cc:{rid}")
def sees_own(rid: str, n: int, timeout: float = 20.0) -> dict[str, Any]:
    """Waits (up to ``timeout``) until ``n`` of its kind run at once, then reports its leases."""
    import threading

    r = ledger()
    r.incr(ledger_key("sees_own"))
    deadline = time.monotonic() + timeout
    together = False
    while time.monotonic() < deadline:
        if int(r.get(ledger_key("sees_own")) or 0) >= n:
            together = True
            break
        time.sleep(0.02)
    return {
        "thread": threading.current_thread().name,
        "together": together,
        "leases": [lease.resource for lease in current_leases()],
    }


# --- lease options on a task without base=LeasedTask (celery-once style) ------------------
@app.task(lease="res:{rid}")
def plain_guarded(rid: str, seconds: float = 0.0) -> dict[str, Any]:
    """``@app.task(lease=...)`` without ``base=LeasedTask``: Leases(app) gives it the lease."""
    return _guarded(seconds)


@app.task(lease="res:{rid}", on_busy="skip")
def plain_skip(rid: str) -> dict[str, Any]:
    """As :func:`plain_guarded`, skipped while ``res:<rid>`` is held elsewhere."""
    return _guarded(0)
