"""Unique tasks: at most one copy per rendered key queued or running (docs/unique.md)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final, Protocol, get_args

from celery import signals as celery_signals
from celery import states
from celery.result import AsyncResult, EagerResult
from celery.utils.log import get_logger
from kombu.utils.uuid import uuid

from . import signals
from ._claims import ClaimHolder, ClaimMode
from ._lease import Held, Lease, held_of
from ._modes import (
    MODE_HEADER,
    PER_CALL,
    UNIQUE_HEADER,
    UniqueMode,
    check_beat_entries,
    check_mode,
    claim_mode,
    handed_on,
    header,
    keeps_last,
    kept,
    parked_kind,
)
from ._parking import DONE_KEEP_MS, PARKED_HEADER, tombstone, unpark
from ._sync.heartbeat import heartbeat
from .config import OnDuplicate
from .exceptions import DuplicateTask, LeaseBackendError, LeaseConfigError

if TYPE_CHECKING:
    from celery import Celery

    from .app import Leases

__all__ = ("UNIQUE_HEADER", "current_claim", "install", "release_claim", "take_claim")

logger = get_logger(__name__)

#: header celery beat puts on what it sends
_BEAT_HEADER: Final = "celery_beat_task"
#: extra seconds a redelivered task waits, past its lease TTL, for its first run's claim
_REDELIVERY_SLACK: Final = 1.0


class UniqueTask(Protocol):
    """What the producer and worker sides need of a task declared with ``unique=``."""

    name: str
    unique: str | None
    unique_ttl: float | None
    on_duplicate: OnDuplicate | None
    unique_mode: UniqueMode | None
    unique_window: float | None
    unique_max_wait: float | None
    unique_cancel_deadline: float | None
    unique_confirm: bool | None

    @property
    def request(self) -> Any: ...

    def _unique_key(self, args: Any, kwargs: Any) -> str: ...


@dataclass
class _Running:
    """A claim this process took over for a task it runs."""

    key: str
    lease: Lease


#: task id -> the claim this process holds for it (a retry published from the task's own
#: process puts that claim back in the queued state instead of being refused by it)
_running: dict[str, _Running] = {}
_running_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _running_lock, _unsent_lock
    _running.clear()
    _running_lock = threading.Lock()
    _unsent_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def unique_task_of(task: object) -> UniqueTask | None:
    """``task`` if it is declared with ``unique=`` (a LeasedTask with a template), else None."""
    if task is None or getattr(task, "_unique_template", None) is None:
        return None
    if not callable(getattr(task, "_unique_key", None)):
        return None
    return task  # type: ignore[return-value]


# --- producer side: the send_task wrapper -------------------------------------------------
def install(ext: Leases) -> None:
    """Wrap ``ext.app.send_task`` so that every publish of a unique task claims its key.

    Every publish goes through ``app.send_task``: ``apply_async``/``delay`` (which call it),
    beat (``task.apply_async`` for a task it knows, ``app.send_task`` otherwise), canvas
    signatures, chains, groups and chords, ``self.retry``. Celery's ``before_task_publish``
    signal cannot refuse a publish: an exception raised by a receiver is logged and the
    message is sent anyway (celery 5.7, ``Signal.send``). Idempotent.
    """
    from .app import find_leases  # app.py imports this module: imported here, not at the top

    app = ext.app
    current = app.send_task
    if getattr(current, "_celery_leases_unique", False):
        return

    @functools.wraps(current)
    def send_task(
        name: str,
        args: Any = None,
        kwargs: Any = None,
        countdown: float | None = None,
        eta: Any = None,
        task_id: str | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        per_call = options.pop("on_duplicate", None)
        modes = tuple(options.pop(o, None) for o in PER_CALL)
        task = unique_task_of(options.get("task_type") or _registered(app, name))
        if task is None:
            if any(m is not None for m in modes):  # for a task without unique=: refused
                check_mode(name, None, modes[0], modes[1], None, modes[2])
            return _send(current, name, args, kwargs, countdown, eta, task_id, rest, options)
        if handed_on(task, modes[0], options):
            # a keep_last follow-up published by its hand-on: the claim is reserved for it
            return _send(current, name, args, kwargs, countdown, eta, task_id, rest, options)
        return _publish_unique(
            find_leases(app) or ext,
            current,
            task,
            (per_call, *modes),
            name,
            args,
            kwargs,
            countdown,
            eta,
            task_id,
            rest,
            options,
        )

    send_task._celery_leases_unique = True  # type: ignore[attr-defined]
    app.send_task = send_task  # type: ignore[method-assign]
    celery_signals.task_revoked.connect(
        on_task_revoked, weak=False, dispatch_uid="celery_leases.unique.task_revoked"
    )
    celery_signals.beat_init.connect(
        check_beat_entries, weak=False, dispatch_uid="celery_leases.unique.beat_init"
    )


def _registered(app: Celery, name: str) -> Any:
    """The task ``name`` of ``app``'s registry, or None (a task this process does not know)."""
    # the registry itself, as send_task reads it; tasks declared with @app.task enter it only
    # when the app is finalized, which send_task does not do: without finalizing, a
    # send_task("name") before any other use of the app would skip the claim
    if not getattr(app, "finalized", True) and getattr(app, "autofinalize", False):
        app.finalize(auto=True)
    registry = getattr(app, "_tasks", None)
    get = getattr(registry, "get", None)
    return get(name) if callable(get) else None


def _send(
    send: Callable[..., Any],
    name: str,
    args: Any,
    kwargs: Any,
    countdown: float | None,
    eta: Any,
    task_id: str | None,
    rest: tuple[Any, ...],
    options: dict[str, Any],
) -> Any:
    if rest:
        return send(name, args, kwargs, countdown, eta, task_id, *rest, **options)
    return send(name, args, kwargs, countdown=countdown, eta=eta, task_id=task_id, **options)


def _delay(app: Celery, countdown: float | None, eta: object) -> float:
    """Seconds until the message may run (its countdown or ETA), 0 when it may run at once."""
    if countdown:
        return max(0.0, float(countdown))
    when: datetime | None = None
    if isinstance(eta, datetime):
        when = eta
    elif isinstance(eta, str):
        try:
            when = datetime.fromisoformat(eta)
        except ValueError:
            return 0.0
    if when is None:
        return 0.0
    now: datetime = app.now()
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    if now.tzinfo is None:
        now = now.replace(tzinfo=timezone.utc)
    return max(0.0, (when - now).total_seconds())


def _check_policy(value: object) -> OnDuplicate | None:
    allowed = get_args(OnDuplicate)
    if value is not None and value not in allowed:
        msg = f"on_duplicate={value!r} is not one of {', '.join(allowed)}"
        raise LeaseConfigError(msg)
    return value  # type: ignore[return-value]


def _publish_unique(
    ext: Leases,
    send: Callable[..., Any],
    task: UniqueTask,
    per_call: tuple[object, ...],
    name: str,
    args: Any,
    kwargs: Any,
    countdown: float | None,
    eta: Any,
    task_id: str | None,
    rest: tuple[Any, ...],
    options: dict[str, Any],
) -> Any:
    policy = _check_policy(per_call[0]) or task.on_duplicate or ext.settings.on_duplicate
    task_id = task_id or uuid()
    base_ttl = task.unique_ttl if task.unique_ttl is not None else ext.settings.unique_ttl
    queue_ttl = base_ttl + _delay(ext.app, countdown, eta)
    headers = dict(options.get("headers") or {})
    store = ext.store
    # Our claim to give back if the publish fails: (token) of a claim made or requeued here.
    # Timeline it guards: t0 claim; t1 the broker refuses the message; t2 without this, every
    # later publish of the key is refused for the whole queue TTL, for a task that never was.
    ours: int | None = None
    replaced: str | None = None  # replace: the task id whose queued claim ours took
    # The pending claim to confirm once the message is out (see unique_claim.lua): until
    # then it lives unique_confirm_window, so a claim left without its message (a producer
    # that died, a claim whose reply was lost with Redis then unreachable) frees its key soon.
    pending: int | None = None
    settings = ext.settings
    confirm = task.unique_confirm if task.unique_confirm is not None else settings.unique_confirm
    with _running_lock:
        running = _running.get(task_id)
    key = running.key if running is not None else task._unique_key(args or (), kwargs or {})
    mode = claim_mode(task, per_call, queue_ttl)
    if policy == "cancel" and mode.kind in ("", "r"):  # refuse, throttle or replace
        if mode.window:  # the on_duplicate setting: the task's own options were checked
            msg = f"task {name!r}: on_duplicate='cancel' is not for unique_mode='throttle'"
            raise LeaseConfigError(msg)
        deadline = task.unique_cancel_deadline or settings.unique_cancel_deadline
        reason = f"unique key {key!r}: cancelled by {name}[{task_id}]"
        mode = replace(mode, cancel=deadline, reason=reason)
    if parked_kind(mode) or mode.cancel:
        mode = kept(mode, key, name, args, kwargs, options)
    try:
        _give_back_unsent(ext)
        if running is not None and _requeue(ext, task_id, running, queue_ttl):
            ours = running.lease.token
        else:
            # unique_confirm off: the claim lives the queue TTL at once, and nothing confirms it
            window = min(settings.unique_confirm_window, queue_ttl) if confirm else queue_ttl
            outcome = store.unique_claim(key, task_id, window, mode)
            if isinstance(outcome, ClaimHolder):
                return _duplicate(ext, task, name, policy, outcome, task_id, headers, options)
            if outcome.cancels is not None:
                logger.info(
                    "leases: %s[%s] not sent yet: the running copy (%s) of unique key %r is "
                    "asked to stop; this send runs after it, within %.1fs",
                    name,
                    task_id,
                    outcome.cancels,
                    key,
                    outcome.deadline,
                )
                return _result(ext, options, task_id)
            if outcome.follows is not None:
                logger.info(
                    "leases: %s[%s] not sent: its arguments go to %s (unique key %r, keep_last)",
                    name,
                    task_id,
                    outcome.follows,
                    key,
                )
                return _result(ext, options, outcome.follows)
            if not outcome.again:
                ours = outcome.token
            pending, replaced = (outcome.token if confirm else None), outcome.replaced
            logger.debug("leases: claimed unique key %r for %s[%s]", key, name, task_id)
            if replaced is not None:
                logger.info(
                    "leases: %s[%s] replaces queued %s: unique key %r", name, task_id, replaced, key
                )
    except LeaseBackendError as exc:
        # A task's retry of itself (self.retry, a busy retry, on_backend_error="retry") is
        # sent even when Redis fails: Celery rejects a task whose retry cannot be published,
        # without requeueing it, so refusing here would lose it. Its claim (queued for it, or
        # still running under this process until the TTL) lets the worker that gets the
        # retry take the key over; a copy that got in meanwhile makes the retry a duplicate.
        if running is None and task.request.id != task_id:
            if exc.maybe_claimed:
                # nothing is published: a claim the lost call made is given back by task id
                # at this process's next unique send, and frees itself within the window
                _unsent(ext, key, task_id)
            raise
        logger.warning(
            "leases: %s[%s] sends its retry without renewing its unique claim %r: %s",
            name,
            task_id,
            key,
            exc,
        )
    headers[UNIQUE_HEADER] = key
    if parked_kind(mode):
        headers[MODE_HEADER] = parked_kind(mode)
    options["headers"] = headers
    try:
        result = _send(send, name, args, kwargs, countdown, eta, task_id, rest, options)
    except BaseException:
        if ours is not None:
            try:
                store.unique_unclaim(key, task_id, ours, replaced)
            except Exception:
                logger.exception("leases: could not give back the unique claim %r", key)
            else:
                logger.info(
                    "leases: publish of %s[%s] failed; its unique claim %r is released",
                    name,
                    task_id,
                    key,
                )
        raise
    if pending is not None:
        _confirm(ext, name, key, task_id, pending, queue_ttl, mode)
    return result


def _result(ext: Leases, options: Mapping[str, Any], task_id: str) -> AsyncResult[Any]:
    """The ``AsyncResult`` a send returns for ``task_id`` (a send's own ``result_cls``)."""
    result_cls = options.get("result_cls") or ext.app.AsyncResult
    result: AsyncResult[Any] = result_cls(task_id)
    return result


def _confirm(
    ext: Leases, name: str, key: str, task_id: str, token: int, ttl: float, mode: ClaimMode
) -> None:
    """The message of ``task_id`` is published: its pending claim now lives ``ttl`` (and
    its throttle window, if any, its full length from now)."""
    try:
        confirmed = ext.store.unique_confirm(key, task_id, token, ttl, mode)
    except LeaseBackendError as exc:
        # the message is out: nothing to refuse; its claim lapses at the end of the window,
        # after which the key may take another copy (a worker still runs one at a time)
        logger.error(
            "leases: %s[%s] is published but its unique claim %r could not be confirmed; it "
            "lapses within unique_confirm_window (%.0fs): %s",
            name,
            task_id,
            key,
            ext.settings.unique_confirm_window,
            exc,
        )
        return
    if not confirmed:
        # a worker took it over already (it may even have finished): nothing to confirm
        logger.debug("leases: unique claim %r of %s[%s] was not pending", key, name, task_id)


#: claims that a send's lost reply may have made for a task never published, per app:
#: (id of the Leases, key) -> task id; given back at the next unique send of the process
_unsent_claims: dict[tuple[int, str], str] = {}
_unsent_lock = threading.Lock()


def _unsent(ext: Leases, key: str, task_id: str) -> None:
    with _unsent_lock:
        _unsent_claims[(id(ext), key)] = task_id


def _give_back_unsent(ext: Leases) -> None:
    """Give back, by task id, the claims this process's failed sends may have left."""
    with _unsent_lock:
        todo = [(k, t) for (owner, k), t in _unsent_claims.items() if owner == id(ext)]
    for key, task_id in todo:
        try:
            released = ext.store.unique_unclaim(key, task_id)
        except LeaseBackendError:
            return  # Redis still fails: the next send tries again (the window bounds it)
        with _unsent_lock:
            if _unsent_claims.get((id(ext), key)) == task_id:
                del _unsent_claims[(id(ext), key)]
        if released:
            logger.info(
                "leases: gave back unique key %r, claimed for %s whose send failed", key, task_id
            )


def _requeue(ext: Leases, task_id: str, running: _Running, queue_ttl: float) -> bool:
    """Put this process's claim for ``task_id`` back in the queued state (a retry)."""
    held = held_of(running.lease)
    # Stop renewing it first, and mark it released so the task's finalizer leaves it alone.
    # Timeline: t0 the requeue rewrites the claim; t1 a renewal of the running claim finds
    # it gone and would report it lost, interrupting the body that is publishing its retry.
    heartbeat().discard(held)
    if not held.mark_released():
        return False
    with _running_lock:
        if _running.get(task_id) is running:
            del _running[task_id]
    if ext.store.unique_requeue(held, queue_ttl):
        logger.info("leases: unique key %r is queued again for %s", running.key, task_id)
        return True
    return False


def keep_queued(ext: Leases, task: Any, task_id: str) -> bool:
    """A task parked by ``on_busy="defer"`` keeps its unique claim: queued again for its task
    id (as a retry's is), so the copy a hand-on publishes is its holder. False when this
    process holds no claim for it."""
    with _running_lock:
        running = _running.get(task_id)
    if running is None:
        return False
    queue_ttl = task.unique_ttl if task.unique_ttl is not None else ext.settings.unique_ttl
    return _requeue(ext, task_id, running, queue_ttl)


def _duplicate(
    ext: Leases,
    task: UniqueTask,
    name: str,
    policy: OnDuplicate,
    holder: ClaimHolder,
    task_id: str,
    headers: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Any:
    """Apply ``policy`` to a publish refused because ``holder`` has the key."""
    beat = bool(headers.get(_BEAT_HEADER))
    if holder.state == "throttled":
        logger.info(
            "leases: %s%s not sent: unique key %r is held by the throttle window of task %s",
            "beat: " if beat else "",
            name,
            holder.key,
            holder.task_id,
        )
    else:
        logger.info(
            "leases: %s%s not sent: unique key %r is held by %s task %s",
            "beat: " if beat else "",
            name,
            holder.key,
            holder.state,
            holder.task_id or "(unknown)",
        )
    try:
        signals.unique_duplicate.send(
            sender=name,
            key=holder.key,
            task_id=task_id,
            holder_task_id=holder.task_id,
            state=holder.state,
            policy=policy,
        )
    except Exception:
        logger.exception("leases: a receiver of unique_duplicate failed")
    if policy in ("existing", "cancel") and holder.task_id is not None:
        return _result(ext, options, holder.task_id)
    if policy in ("raise", "existing", "cancel") and not beat:
        # beat has no caller to tell: it logs (above) and sends nothing
        raise DuplicateTask(holder.key, holder.task_id, holder.state, holder.expires_in)
    return EagerResult(task_id, None, states.REJECTED)


# --- worker side --------------------------------------------------------------------------
def take_claim(
    ext: Leases,
    task: UniqueTask,
    task_id: str,
    request: Any,
    args: Any,
    kwargs: Any,
    ttl: float,
    on_lost: Callable[[Held], None] | None,
) -> Lease | None:
    """Take over ``task``'s unique claim at task start; None: a duplicate, do not run it.

    The key comes from the message header the producer wrote (what it claimed), else it is
    rendered here (a producer that did not know the task published it without a claim).
    """
    key = header(request, UNIQUE_HEADER)
    if not isinstance(key, str) or not key:
        key = task._unique_key(args, kwargs)
    started = time.monotonic()
    handed = None
    if keeps_last(task, request) and header(request, PARKED_HEADER):
        again = "1" if (request.delivery_info or {}).get("redelivered") else ""
        handed = (tombstone(task_id, getattr(request, "retries", 0)), DONE_KEEP_MS, again)
    wait = ttl + _REDELIVERY_SLACK
    outcome = ext.store.unique_take(key, task_id, ext.identity(), ttl, wait, handed)
    if isinstance(outcome, ClaimHolder) and outcome.state == "replaced":
        if handed:
            text = "leases: %s[%s] not run: its keep_last follow-up ran already (unique key %r)"
        else:
            text = "leases: %s[%s] not run: a later send replaced it (unique key %r)"
        logger.info(text, task.name, task_id, key)
        return None
    if isinstance(outcome, ClaimHolder):
        logger.info(
            "leases: %s[%s] not run: unique key %r is held by %s task %s",
            task.name,
            task_id,
            key,
            outcome.state,
            outcome.task_id or "(unknown)",
        )
        return None
    held = outcome
    if on_lost is not None:
        held.on_lost.append(on_lost)
    heartbeat().add(held, ext.store)
    lease = Lease(held.resource, held.token, held.ttl, False, held)
    with _running_lock:
        _running[task_id] = _Running(key, lease)
    logger.info("leases: %s[%s] holds unique key %r", task.name, task_id, key)
    try:
        signals.lease_acquired.send(
            sender=held.resource,
            resource=held.resource,
            token=held.token,
            owner=held.owner,
            ttl=ttl,
            shared=False,
            task_id=task_id,
            elapsed=time.monotonic() - started,
        )
    except Exception:
        logger.exception("leases: a receiver of lease_acquired failed")
    return lease


def current_claim() -> Lease | None:
    """The unique claim of the running task, as a :class:`~celery_leases.Lease` (None outside
    a run of a task declared with ``unique=``).

    Its ``.token`` fences the run's writes (a later run's claim has a larger one), and
    ``.check()`` raises :class:`~celery_leases.LeaseRevoked` once a send with
    ``on_duplicate="cancel"`` asked the run to stop (``on_lost="log"``: the body learns there)::

        @app.task(base=LeasedTask, unique="sync:{repo}", on_lost="log")
        def sync(repo):
            for chunk in chunks(repo):
                current_claim().check()
                store.set(f"sync:{repo}", chunk, fence=current_claim())

    .. versionadded:: 0.2
    """
    from celery import current_task  # the running task's request, as Celery tracks it

    task_id = getattr(getattr(current_task, "request", None), "id", None)
    with _running_lock:
        running = _running.get(task_id) if isinstance(task_id, str) else None
    return running.lease if running is not None else None


def release_claim(ext: Leases, task_id: str, lease: Lease) -> None:
    """Release the claim ``lease`` at the task's end (a no-op once a retry queued it again)."""
    with _running_lock:
        running = _running.get(task_id)
        if running is not None and running.lease is lease:
            del _running[task_id]
    ext.release([lease])


def on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """Worker: a message discarded before it ran (revoked, expired) gives its claim back.

    A terminated task is not handled here: its claim is a lease of the process that ran it,
    released by its finalizer or by the reaper of dead pool processes.
    """
    try:
        task = unique_task_of(sender)
        if task is None or terminated or request is None:
            return
        task_id = getattr(request, "id", None)
        if not isinstance(task_id, str):
            return
        from .app import find_leases  # app.py imports this module: imported here, not at the top

        ext = find_leases(getattr(sender, "app", None))
        if ext is None:
            return
        store = ext.store
        key = header(request, UNIQUE_HEADER)
        if not isinstance(key, str) or not key:
            key = task._unique_key(getattr(request, "args", ()), getattr(request, "kwargs", {}))
        if store.unique_unclaim(key, task_id):
            logger.info("leases: revoked %s[%s] gave back unique key %r", task.name, task_id, key)
        if keeps_last(task, request) and unpark(ext, task_id):
            # the arguments later sends gave it, parked in case it was never published
            logger.info(
                "leases: revoked %s[%s]: its newer arguments do not run", task.name, task_id
            )
    except Exception:
        logger.exception("leases: task_revoked handler (unique claims) failed")
