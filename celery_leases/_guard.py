"""The redelivery guard: no task runs twice because the broker delivered its message again.

With the ``redelivery_guard`` setting on, a consumer bootstep wraps the worker's per-task
strategies (``consumer.strategies``), so it sees each delivery of every task (plain
``@app.task`` included) in the main process, before Celery schedules it (ETA included):

- **A lease per delivery.** The main process takes the lease ``celery_leases:redelivery:<task
  id>`` (``#<retries>`` for a retry, which is a new message) before it hands the delivery to
  Celery, and gives it back when the message is settled: acked at the end of an ``acks_late``
  task, acked at the start of any other (once it started, no copy may run), or rejected. The
  lease is renewed by the process's heartbeat with the rest of what it holds, and freed by the
  owner registry's cleanups like any lease when its worker dies.
- **A completion record.** The process that ran an ``acks_late`` task writes, before it reports
  back (``task_postrun``), the state the delivery ended in; the main process writes one when it
  acks any other task. Every delivery reads it once it has its lease, flagged redelivered
  or not: a copy that arrives after a lost ack, or a second message of the same task id
  (kombu's publish retry after a lost confirm), finds it and is dropped.
- **A copy waits for the outcome.** A delivery whose lease is busy is not handed to Celery: it
  looks again every ``redelivery_recheck`` seconds on the worker's timer. Once it gets the
  lease, a completion record means the first copy finished: it is acked and dropped. No record
  means the first copy died unfinished: it runs.
- **Redis transport: no restore while the worker lives.** kombu restores a delivery whose score
  in ``unacked_index`` is older than ``visibility_timeout``. A thread of the main process sets
  the score of every delivery it holds to now (``ZADD XX``, one command for all of them) every
  ``visibility_timeout / 3``, so visibility_timeout becomes a liveness timeout.

Delivery stays at least once: a copy runs again when the first died before its end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from celery import bootsteps
from celery.utils.log import get_logger

from . import signals
from ._lease import Lease, Want
from ._parking import PARKED_HEADER, ended_parked
from .exceptions import LeaseBusy, LeaseError

if TYPE_CHECKING:
    from .app import Leases

__all__ = ("GuardStep", "KeepAlive", "RedeliveryGuard", "on_task_postrun")

logger = get_logger(__name__)

#: marks a strategy this module already wrapped
_WRAPPED: Final = "__celery_leases_guarded__"
#: the completion record of a task acked at its start (not acks_late): it started, so no
#: other copy may run (that is what an early ack means)
STARTED: Final = "STARTED"
#: bounds of the keep-alive's period (seconds)
_KEEPALIVE_MIN: Final = 0.1
_KEEPALIVE_MAX: Final = 60.0

Strategy = Callable[..., Any]


def guard_id(task_id: str, parked: object) -> str:
    """The id a delivery's guard is keyed by: its task id, and for the copy a hand-on of a
    parked task published (header ``lease_parked``, see _parking.py) that copy's generation.
    The copy is a new message, as a retry is: the delivery that parked the task ended without
    running it, and the completion record of that delivery must not drop the copy; a
    redelivery of the copy is a copy of the copy."""
    return f"{task_id}~parked{parked}" if parked else task_id


def delivery_of(message: Any, body: Any) -> tuple[str, int, bool] | None:
    """``(task id, retries, redelivered)`` of a task message; None if it names no task id."""
    headers = getattr(message, "headers", None) or {}
    if "id" in headers and "task" in headers:  # protocol 2
        task_id, retries = headers.get("id"), headers.get("retries")
    elif isinstance(body, dict):  # protocol 1, decoded by the consumer
        task_id, retries = body.get("id"), body.get("retries")
    else:
        return None
    if not isinstance(task_id, str) or not task_id:
        return None
    info = getattr(message, "delivery_info", None) or {}
    redelivered = bool(info.get("redelivered") or headers.get("redelivered"))
    return task_id, int(retries or 0), redelivered


class KeepAlive:
    """Keeps this process's deliveries on the Redis transport from being restored.

    kombu's Redis transport keeps each unacknowledged delivery in the ``unacked`` hash, scored
    in the ``unacked_index`` zset by the time it was delivered; any worker's restore sweep puts
    back in its queue a delivery scored before ``now - visibility_timeout``. This thread sets
    the score of every delivery the process holds to now, ``ZADD unacked_index XX``: XX never
    brings back a delivery that was acked meanwhile. It talks to the broker's Redis on a
    connection of its own from kombu's (synchronous) pool, not to the leases Redis.
    """

    def __init__(self) -> None:
        self._tags: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._key = ""
        self._channel: Any = None
        self.interval = _KEEPALIVE_MAX
        self.calls = 0  # ZADD commands sent (for tests and benchmarks)
        self.failing = False

    def attach(self, channel: Any) -> bool:
        """Use the Redis channel ``channel`` (kombu's); False if it is not a Redis channel."""
        try:
            from kombu.transport.redis import Channel as RedisChannel
        except ImportError:  # pragma: no cover - redis is a dependency
            return False
        if not isinstance(channel, RedisChannel):
            return False
        if channel is self._channel:
            return True
        import redis

        with self._lock:
            self._channel = channel
            self._client = redis.Redis(connection_pool=channel.pool)
            self._key = f"{channel.global_keyprefix}{channel.unacked_index_key}"
            period = float(channel.visibility_timeout) / 3
            self.interval = max(_KEEPALIVE_MIN, min(_KEEPALIVE_MAX, period))
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="celery-leases-keepalive", daemon=True
                )
                self._thread.start()
        return True

    def add(self, tag: str | None) -> None:
        if tag:
            with self._lock:
                self._tags[tag] += 1

    def discard(self, tag: str | None) -> None:
        if tag:
            with self._lock:
                left = self._tags[tag] - 1
                if left > 0:
                    self._tags[tag] = left
                else:
                    del self._tags[tag]

    def held(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.touch()

    def touch(self) -> None:
        """Set the score of every delivery held to now (one command); errors are logged."""
        with self._lock:
            tags, client, key = list(self._tags), self._client, self._key
        if not tags or client is None:
            return
        now = time.time()
        try:
            self.calls += 1
            client.zadd(key, dict.fromkeys(tags, now), xx=True)
        except Exception as exc:
            if not self.failing:
                logger.error("leases: could not keep %d delivery(ies) fresh: %s", len(tags), exc)
            self.failing = True
            return
        if self.failing:
            logger.warning("leases: deliveries are kept fresh again")
        self.failing = False


@dataclass(eq=False)
class _Delivery:
    """One delivery of a task message, from its arrival to its ack or reject."""

    strategy: Strategy
    message: Any
    body: Any
    ack: Callable[..., Any]
    reject: Callable[..., Any]
    callbacks: Any
    kwargs: dict[str, Any]
    task_id: str
    retries: int
    redelivered: bool
    acks_late: bool
    name: str
    tag: str | None
    leases: list[Lease] = field(default_factory=list)
    settled: bool = False
    waiting_since: float | None = None
    #: the id its guard lease and completion record are keyed by (see :func:`guard_id`)
    key_id: str = ""


class RedeliveryGuard:
    """The guard of one worker's main process (made by :class:`GuardStep`)."""

    def __init__(self, ext: Leases, consumer: Any) -> None:
        self.ext = ext
        self.consumer = consumer
        self.keepalive = KeepAlive()
        self._lock = threading.Lock()
        #: the deliveries of the consumer's connection not settled yet (waiting ones included)
        self._open: set[_Delivery] = set()
        #: deliveries by outcome: guarded, and the ``redelivery_guarded`` signal's outcomes
        self.counts: Counter[str] = Counter()

    # --- wrapping -----------------------------------------------------------------------
    def wrap_strategies(self) -> None:
        """Wrap every strategy of the consumer (again after each connection restart)."""
        strategies = self.consumer.strategies
        for name, strategy in list(strategies.items()):
            if getattr(strategy, _WRAPPED, False):
                continue
            task = self.consumer.app.tasks.get(name)
            strategies[name] = self.wrap(name, strategy, bool(getattr(task, "acks_late", False)))

    def wrap(self, name: str, strategy: Strategy, acks_late: bool) -> Strategy:
        def guarded(
            message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any
        ) -> Any:
            found = delivery_of(message, body)
            if found is None:
                return strategy(message, body, ack, reject, callbacks, **kwargs)
            task_id, retries, redelivered = found
            tag = getattr(message, "delivery_tag", None)
            if tag is not None and self.keepalive.attach(getattr(message, "channel", None)):
                tag = str(tag)
            else:
                tag = None
            d = _Delivery(
                strategy, message, body, ack, reject, callbacks, kwargs, task_id, retries,
                redelivered, acks_late, name, tag,
            )  # fmt: skip
            headers = getattr(message, "headers", None) or {}
            d.key_id = guard_id(task_id, headers.get(PARKED_HEADER))
            with self._lock:
                self._open.add(d)
            return self._admit(d)

        setattr(guarded, _WRAPPED, True)
        return guarded

    # --- a delivery's way in ------------------------------------------------------------
    def _admit(self, d: _Delivery) -> Any:
        """Hand ``d`` to Celery if no other copy holds its lease; else let it wait."""
        if d.settled:  # its connection was lost while it waited: the broker has it back
            return None
        resource = self.ext.store.keys.redelivery_resource(d.key_id, d.retries)
        first = d.waiting_since is None
        try:
            d.leases = self.ext.acquire([Want(resource)], wait=0.0, task_id=d.task_id)
        except LeaseBusy:
            if first:
                d.waiting_since = time.monotonic()
                self._count(d, "waiting")
                self.keepalive.add(d.tag)
                # as for an ETA task: a copy that waits must not take the prefetch slot of
                # the next message (a worker of -c 1 would take nothing else meanwhile)
                self._prefetch(+1)
                logger.warning(
                    "leases: task %s[%s] was delivered again while another copy holds it; "
                    "waiting for that copy's outcome",
                    d.name,
                    d.task_id,
                )
            self._look_later(d)
            return None
        except LeaseError as exc:
            # at least once: the guard must not lose a task because the leases Redis failed
            self._count(d, "unguarded")
            logger.error(
                "leases: task %s[%s] runs without its redelivery guard: %s", d.name, d.task_id, exc
            )
            if not first:
                self.keepalive.discard(d.tag)
                self._prefetch(-1)
            self._forget(d)
            return d.strategy(d.message, d.body, d.ack, d.reject, d.callbacks, **d.kwargs)
        # every delivery, flagged redelivered or not: a second message of a task id that
        # already ended (kombu's publish retry after a lost confirm sends one) is a copy too
        try:
            done = self.ext.store.get_delivery_done(d.key_id, d.retries)
        except LeaseError as exc:
            logger.error(
                "leases: could not read the completion record of %s[%s]: %s",
                d.name,
                d.task_id,
                exc,
            )
            done = None
        if done is not None:
            self._drop(d, done)
            return None
        if first:
            self.keepalive.add(d.tag)
        else:
            self._prefetch(-1)
            self._count(d, "ran")
            logger.warning(
                "leases: task %s[%s]: its other copy ended unfinished; this one runs",
                d.name,
                d.task_id,
            )
        self.counts["guarded"] += 1
        try:
            return d.strategy(
                d.message, d.body, self._acker(d), self._rejecter(d), d.callbacks, **d.kwargs
            )
        except BaseException:
            self._settle(d)
            raise

    def _prefetch(self, step: int) -> None:
        qos = getattr(self.consumer, "qos", None)
        if qos is None:
            return
        try:
            if step > 0:
                qos.increment_eventually()
            else:
                qos.decrement_eventually()
        except Exception:
            logger.debug("leases: could not change the prefetch count", exc_info=True)

    def _count(self, d: _Delivery, outcome: str) -> None:
        """Count ``outcome`` and send the ``redelivery_guarded`` signal (receivers' errors are
        logged)."""
        self.counts[outcome] += 1
        try:
            signals.redelivery_guarded.send(
                sender=d.name, task_id=d.task_id, retries=d.retries, outcome=outcome
            )
        except Exception:
            logger.exception("leases: a redelivery_guarded receiver failed")

    def _look_later(self, d: _Delivery) -> None:
        timer = getattr(self.consumer, "timer", None)
        delay = self.ext.settings.redelivery_recheck
        if timer is not None:
            timer.call_after(delay, self._look, (d,), priority=6)
        else:  # pragma: no cover - a consumer always has a timer
            t = threading.Timer(delay, self._look, (d,))
            t.daemon = True
            t.start()

    def _look(self, d: _Delivery) -> None:
        try:
            self._admit(d)
        except Exception:
            logger.exception("leases: redelivery guard failed on task %s[%s]", d.name, d.task_id)

    def _drop(self, d: _Delivery, state: str) -> None:
        """Ack and drop ``d``: its delivery already ended in ``state`` elsewhere."""
        self._count(d, "dropped")
        logger.warning(
            "leases: dropped a copy of task %s[%s] delivered again: that delivery already "
            "ended (%s)",
            d.name,
            d.task_id,
            state,
        )
        d.settled = True
        self._forget(d)
        self.keepalive.discard(d.tag)
        if d.waiting_since is not None:
            self._prefetch(-1)
        try:
            d.ack(logger, self.consumer.connection_errors)
        finally:
            self.ext.release(d.leases)
            d.leases = []

    # --- a delivery's way out -----------------------------------------------------------
    def _acker(self, d: _Delivery) -> Callable[..., Any]:
        def ack(*args: Any, **kwargs: Any) -> Any:
            if not d.acks_late and not d.settled:
                # acked at its start: from now on no copy may run
                self._record(d, STARTED)
            try:
                return d.ack(*args, **kwargs)
            finally:
                self._settle(d)

        return ack

    def _rejecter(self, d: _Delivery) -> Callable[..., Any]:
        def reject(*args: Any, **kwargs: Any) -> Any:
            requeue = bool(kwargs.get("requeue", args[2] if len(args) > 2 else False))
            if requeue:
                self._settle(d)  # the copy put back must find the lease free
                return d.reject(*args, **kwargs)
            try:
                return d.reject(*args, **kwargs)
            finally:
                self._settle(d)

        return reject

    def _record(self, d: _Delivery, state: str) -> None:
        try:
            self.ext.store.put_delivery_done(
                d.key_id, d.retries, state, self.ext.settings.redelivery_record_ttl
            )
        except LeaseError as exc:
            logger.error(
                "leases: could not write the completion record of %s[%s]: %s",
                d.name,
                d.task_id,
                exc,
            )

    def _settle(self, d: _Delivery) -> None:
        with self._lock:
            self._open.discard(d)
            if d.settled:
                return
            d.settled = True
            leases, d.leases = d.leases, []
        self.keepalive.discard(d.tag)
        if leases:
            self.ext.release(leases)

    def _forget(self, d: _Delivery) -> None:
        with self._lock:
            self._open.discard(d)

    def connection_lost(self, running: set[str]) -> None:
        """The consumer's connection is gone (it restarts, or the worker stops).

        Its deliveries can no longer be acked, and the broker gives their messages back (the
        Redis transport restores them when the channel closes; RabbitMQ when the connection
        does). Celery drops the requests that did not start (reserved, waiting for an ETA),
        so their leases are given back for the copies to come. A task still running
        (``running``: task ids) keeps its lease: its copy waits for its outcome, as after
        any redelivery. A copy that was waiting stops looking.
        """
        with self._lock:
            todo = list(self._open)
        for d in todo:
            if d.leases and d.task_id in running:
                continue
            self._settle(d)


class GuardStep(bootsteps.StartStopStep):
    """Consumer bootstep: wraps the task strategies when ``redelivery_guard`` is on.

    It starts after the consumer's Tasks step, which makes the strategies (again after each
    connection restart), and before the event loop consumes the first message.

    .. versionadded:: 0.2
    """

    label = "LeasesRedeliveryGuard"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.guard: RedeliveryGuard | None = None

    def start(self, c: Any) -> None:
        from .app import find_leases  # app.py imports worker, which imports this module

        ext = find_leases(c.app)
        if ext is None or not ext.settings.redelivery_guard:
            return
        if self.guard is None:
            self.guard = RedeliveryGuard(ext, c)
            logger.info("leases: the redelivery guard is on")
            _check_record_ttl(ext, c.app.conf)
        self.guard.wrap_strategies()

    def stop(self, c: Any) -> None:
        if self.guard is not None:
            from celery.worker import state as worker_state

            running = {getattr(r, "id", None) for r in tuple(worker_state.active_requests)}
            self.guard.connection_lost({r for r in running if isinstance(r, str)})

    def shutdown(self, c: Any) -> None:
        if self.guard is not None:
            self.guard.keepalive.stop()


def _check_record_ttl(ext: Leases, conf: Any) -> None:
    """Warn when a completion record may run out before a Redis redelivery can come."""
    url = conf.broker_url
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "sentinel://")):
        return
    options = conf.broker_transport_options or {}
    try:
        visibility = float(options.get("visibility_timeout", 3600))
        sweep = float(options.get("unacked_restore_interval", 10)) * float(
            options.get("unacked_restore_throttle", 10)
        )
    except (TypeError, ValueError):
        return
    record_ttl = ext.settings.redelivery_record_ttl
    if record_ttl < visibility + sweep:
        logger.warning(
            "leases: redelivery_record_ttl (%.0fs) is shorter than the broker's "
            "visibility_timeout plus its restore sweep (%.0fs): a task whose ack is lost may "
            "run again when it is redelivered",
            record_ttl,
            visibility + sweep,
        )


def on_task_postrun(
    sender: Any = None, task_id: str | None = None, state: str | None = None, **kwargs: Any
) -> None:
    """Where an ``acks_late`` task ran: record the end of its delivery before the ack.

    A worker killed between the end and the ack leaves a record that makes the copy delivered
    again be dropped. A rejected task (``Reject``) is left without one: it asked to run again.
    """
    task = kwargs.get("task", sender)
    if task is None or task_id is None or state in (None, "REJECTED"):
        return
    try:
        if not getattr(task, "acks_late", False):
            return
        request = task.request
        if request.is_eager or request.called_directly:
            return
        from .app import find_leases  # app.py imports worker, which imports this module

        ext = find_leases(task.app)
        if ext is None or not ext.settings.redelivery_guard:
            return
        if ended_parked(task_id):
            return  # parked, not ended: the copy a hand-on publishes is to run
        ext.store.put_delivery_done(
            guard_id(task_id, getattr(request, PARKED_HEADER, None)),
            int(request.retries or 0),
            str(state),
            ext.settings.redelivery_record_ttl,
        )
    except LeaseError as exc:
        logger.error("leases: could not write the completion record of %s: %s", task_id, exc)
    except Exception:
        logger.exception("leases: task_postrun handler of the redelivery guard failed")
