"""The Celery app the fault suite runs in real ``celery worker`` processes.

Configured from the environment by the suite (tests/faults/conftest.py):

- ``FAULTS_BROKER``, ``FAULTS_QUEUE``: the broker (RabbitMQ, or a private Redis for the
  kill scenario on the Redis transport; never the Redis under test) and the scenario's queue.
  On Redis, ``FAULTS_VISIBILITY_TIMEOUT`` (seconds) is the transport's ``visibility_timeout``
  and its restore sweep runs every second.
- ``FAULTS_LEDGER_URL``, ``FAULTS_LEDGER_PREFIX``: the ledger (see tests/faults/ledger.py).
- ``FAULTS_NODE``: this worker's node name; with ``FAULTS_CLOCK=1`` the worker's wall clock
  (``time.time``) follows the offset the suite sets for that node in the ledger, to simulate a
  clock jump on one worker.
- every ``CELERY_LEASES_*`` setting: the leases live on the Redis under test.

Tasks use ``acks_late`` with ``reject_on_worker_lost``, so a task whose process is killed is
delivered again. A task retries (counted in the ledger) when its lease is lost inside the body
(``LeaseLost``, by this suite's policy) or when Redis cannot be reached to take the lease
(``LeaseBackendError``, by the library's ``on_backend_error="retry"``); any other failure is
recorded and counts as a lost task.

Every message a worker publishes gets a message id of its own (``before_task_publish``), and
every message a worker receives is recorded (``task_received``), so that a task that never
completed tells a message the broker lost (never received) from one of ours.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Any, Final

from celery import Celery, signals

from celery_leases import LeasedTask, LeaseLost, Leases, current_leases
from celery_leases._lease import Lease
from celery_leases._parking import PARKED_HEADER, parked_observers
from celery_leases.exceptions import LeaseBackendError
from tests.faults.ledger import FIRST_MESSAGE, MESSAGE_HEADER, Ledger

#: countdown of a retry after the lease was lost in the body, or Redis was unreachable
RETRY_COUNTDOWN: Final = 0.2
#: seconds between two writes of a probe task
PROBE_STEP: Final = 0.02
#: longest blocking call in a task body (see _busy)
WORK_STEP: Final = 0.02

QUEUE = os.environ.get("FAULTS_QUEUE", "faults")
NODE = os.environ.get("FAULTS_NODE", "")
ledger = Ledger(
    os.environ.get("FAULTS_LEDGER_URL", "redis://127.0.0.1:6379/15"),
    os.environ.get("FAULTS_LEDGER_PREFIX", "faults"),
)

app = Celery("faults_app", broker=os.environ.get("FAULTS_BROKER", "amqp://guest:guest@127.0.0.1//"))
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_enable_remote_control=False,
)
if app.conf.broker_url.startswith("redis"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ.get("FAULTS_VISIBILITY_TIMEOUT", "15")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
leases = Leases(app)


# --- what the broker delivered ---------------------------------------------------------------
@signals.before_task_publish.connect
def _name_message(headers: dict[str, Any], **_: Any) -> None:
    """Give every message published here (a retry of any kind) a message id of its own."""
    headers[MESSAGE_HEADER] = uuid.uuid4().hex
    if headers.get(PARKED_HEADER):  # a parked task's copy, published by a hand-on
        ledger.incr("handed_on")


@signals.after_task_publish.connect
def _published(headers: dict[str, Any], **_: Any) -> None:
    if MESSAGE_HEADER in headers:
        ledger.published(headers["id"], headers[MESSAGE_HEADER])


@signals.task_received.connect
def _received(request: Any, **_: Any) -> None:
    """In the worker's main process, once the transport handed the message over."""
    ledger.received(request.id, request.request_dict.get(MESSAGE_HEADER, FIRST_MESSAGE))


def _parked(task: str, template: str) -> None:
    """A delivery ended parked (on_busy="defer"), in the pool process that parked it."""
    ledger.incr("parked")


parked_observers.append(_parked)


# --- a wall-clock jump on this worker (FAULTS_CLOCK=1) -------------------------------------
_real_time = time.time
_real_time_ns = time.time_ns
_offset = 0.0


def _jumped_time() -> float:
    return _real_time() + _offset


def _jumped_time_ns() -> int:
    return _real_time_ns() + int(_offset * 1e9)


def _follow_offset() -> None:
    global _offset
    while True:
        with contextlib.suppress(Exception):  # keep the last offset if the ledger hiccups
            _offset = ledger.clock_offset(NODE)
        time.sleep(0.05)


def _start_clock_follower() -> None:
    threading.Thread(target=_follow_offset, name="faults-clock", daemon=True).start()


if os.environ.get("FAULTS_CLOCK") == "1":
    time.time = _jumped_time
    time.time_ns = _jumped_time_ns
    _start_clock_follower()
    os.register_at_fork(after_in_child=_start_clock_follower)


# --- the tasks ----------------------------------------------------------------------------
class FaultTask(LeasedTask):
    """LeasedTask with the suite's retry policy for Redis trouble, and failure records."""

    max_retries = None
    acks_late = True
    reject_on_worker_lost = True

    def on_retry(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        # Redis failed as the task took its lease: the library retried it (on_backend_error)
        if isinstance(exc, LeaseBackendError):
            ledger.incr("retried_backend")

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        ledger.failed(task_id, f"{type(exc).__name__}: {exc}")


def _busy(seconds: float) -> None:
    """Work for ``seconds`` in steps of at most WORK_STEP.

    Under the threads pool ``LeaseLost`` arrives as an asynchronous exception at the next
    bytecode: one long blocking call (a single ``time.sleep(2)``) would delay it until the
    call returns, past the moment Redis hands the lease to someone else. A body that runs
    Python code gets it within a step.
    """
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, WORK_STEP))


def _leave(lease: Lease, task_id: str) -> None:
    """Leave the resource in the ledger, even if LeaseLost lands meanwhile (it fires once)."""
    pending: LeaseLost | None = None
    for _ in range(2):
        try:
            ledger.leave(lease.resource, lease.token, task_id)
            break
        except LeaseLost as exc:
            pending = exc
    if pending is not None:
        raise pending


@app.task(base=FaultTask, bind=True, lease="r:{rid}")
def work(self: Any, rid: str, seconds: float) -> None:
    """Enter r:<rid>, write through the fenced store, work ``seconds``, write again, leave."""
    _work(self, seconds)


@app.task(base=FaultTask, bind=True, lease="r:{rid}", on_busy="defer")
def deferred(self: Any, rid: str, seconds: float) -> None:
    """``work`` that parks when r:<rid> is busy (on_busy="defer"): handed on by a release or
    the pump. Each completion is recorded with its process (``Ledger.deferred_done``)."""
    if getattr(self.request, PARKED_HEADER, None):
        ledger.incr("ran_handed_on")
    _work(self, seconds)
    ledger.deferred_done(self.request.id, os.getpid())


def _work(self: Any, seconds: float) -> None:
    (lease,) = current_leases()
    task_id = self.request.id
    try:
        try:
            ledger.enter(lease.resource, lease.token, task_id)
            ledger.write(lease.resource, lease.token, task_id)
            _busy(seconds)
            ledger.write(lease.resource, lease.token, task_id)
        finally:
            _leave(lease, task_id)
        ledger.done(task_id)
    except LeaseLost:
        ledger.incr("retried_lost")
        raise self.retry(countdown=RETRY_COUNTDOWN) from None


def _probe(task_id: str, rid: str, seconds: float) -> None:
    """Stay inside r:<rid>, writing every PROBE_STEP, until ``stop:<rid>`` is set or time ends."""
    (lease,) = current_leases()
    ledger.event(f"started:{rid}", lease.token)
    stop = ledger.key("stop", rid)
    end = time.monotonic() + seconds
    try:
        ledger.enter(lease.resource, lease.token, task_id)
        while time.monotonic() < end and not ledger.r.exists(stop):
            ok = ledger.write(lease.resource, lease.token, task_id)
            ledger.event(f"write:{rid}", f"{lease.token} {int(ok)}")
            time.sleep(PROBE_STEP)
    finally:
        _leave(lease, task_id)


@app.task(base=FaultTask, bind=True, lease="r:{rid}", on_lost="log")
def stubborn(self: Any, rid: str, seconds: float) -> None:
    """A holder that cannot be stopped in time (on_lost="log"): it writes on after a loss."""
    _probe(self.request.id, rid, seconds)
    ledger.done(self.request.id)


@app.task(base=FaultTask, bind=True, lease="r:{rid}", on_lost="interrupt")
def polite(self: Any, rid: str, seconds: float) -> None:
    """A holder interrupted by LeaseLost (on_lost="interrupt"); records when it was told."""
    try:
        _probe(self.request.id, rid, seconds)
    except LeaseLost as exc:
        ledger.event(f"lost:{rid}", exc.resource)
    ledger.done(self.request.id)
