"""Parked tasks (``on_busy="defer"``): park, admit a copy, hand on, the pump.

A task whose lease is busy is parked in Redis (its message, in its resource's FIFO) and its
delivery ends without running the body; a release (or the pump, for a holder that died) hands
the resource on to the head of the FIFO: it reserves the lease for that task id and publishes
the task again, with its id and arguments. See docs/parking.md for the guarantees.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

from celery.exceptions import Ignore, Reject
from celery.utils.log import get_logger
from kombu.utils.json import dumps, loads
from redis.exceptions import RedisError

from . import _scripts
from ._grants import Busy, acquire_group
from ._keys import escape, unescape
from ._lease import Want
from ._limits import LimitWant
from ._parked import (
    DONE_KEEP_MS,
    Parked,
    _call,
    _group_keys,
    _limit_script_keys,
    _ms,
    _text,
    list_parked,
    parked_counts,
    tombstone,
    unpark,
)
from ._registry import PARKED_OWNER
from ._scripts import ParkGateReply, ParkReply
from .exceptions import LeaseBackendError, LeaseBusy, RateLimited

if TYPE_CHECKING:
    from ._cleanup import CleanupReport
    from .app import Leases

__all__ = (
    "DONE_KEEP_MS",
    "PARKED_HEADER",
    "Parked",
    "ended_parked",
    "parked_observers",
    "admit",
    "ahand_on_released",
    "defer",
    "hand_on",
    "hand_on_released",
    "list_parked",
    "parked_counts",
    "parking_used",
    "parks",
    "publish_taken_over",
    "pump",
    "tombstone",
    "unpark",
)

logger = get_logger(__name__)

#: message header of a parked task's copy: how many times it was parked (its generation; the
#: redelivery guard tells copies apart by it)
PARKED_HEADER: Final = "lease_parked"
#: the owner of a hand-on's reservation is this prefix and the escaped task id (acquire.lua)
PLACEHOLDER: Final = PARKED_OWNER
#: at most this many hand-ons of one resource in one call (a Shared lease with room for many)
_MAX_HANDONS: Final = 64
#: due resources the pump hands on per slot group and turn (one head each: round robin)
_PUMP_BATCH: Final = 256


def _due_member(want: Want) -> str:
    return f"{want.mode} {want.limit} {want.resource}"


def _consumer(request: Any) -> str:
    """The message's generation as park_gate.lua records a hand-on's consumer: "g<n>"."""
    return f"g{int(getattr(request, PARKED_HEADER, None) or 0)}"


# --- the task's side ------------------------------------------------------------------------
def admit(
    ext: Leases, task: Any, wants: Sequence[Want], limits: Sequence[LimitWant] = ()
) -> tuple[bool, LeaseBusy | None]:
    """Before a deferring task takes its leases: ``(consumed, behind)``. ``consumed``: True if
    this delivery consumed its hand-on (the lease is reserved for it, or its rate limit had
    room for it), or is a redelivered copy whose hand-on was consumed (by its own run, cut
    short): a park of it then parks it again. ``behind``: for a delivery of a task that is
    not parked, a ``LeaseBusy`` of a resource on which others are parked (not yet handed
    on): it parks behind them without trying the lease, so it cannot take a place freed by
    a release before that release's hand-on; or a ``RateLimited`` of a rate limit with tasks
    in its FIFO (parked, or handed on and not started): its park (park_limit.lua) admits it
    again only if the window has room beyond them and nobody is parked ahead. Raises
    ``Ignore`` for a delivery that must not run: a copy of a task that is parked, or whose
    hand-on another copy consumed, unless another FIFO of the task (it parked again there:
    its limit refused after its lease's hand-on) hands it on now (a redelivery of a copy
    that started is let through: the redelivery guard's business)."""
    request = task.request
    task_id = escape(request.id)
    keys = ext.store.keys
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    behind: LeaseBusy | None = None
    ran = False  # a group's done set holds this message's tombstone
    fifos: dict[int, list[str]] = {}  # slot group -> the task's FIFOs there, leases first
    # slot group -> what each of its FIFOs is busy as, when others are parked there
    busy: dict[int, list[LeaseBusy]] = {}
    for want in wants:
        group = keys.group_of(want.resource)
        fifos.setdefault(group, []).append(keys.parked(want.resource))
        busy.setdefault(group, []).append(LeaseBusy(want.resource))
    leases = {group: len(queues) for group, queues in fifos.items()}
    for limit in limits:
        group = keys.group_of(limit.name)
        fifos.setdefault(group, []).append(keys.parked_limit(limit.name))
        busy.setdefault(group, []).append(RateLimited(limit.name))
    for group, queues in fifos.items():
        state, msgs, done, _ = _group_keys(ext, group)
        keys_ = [state, msgs, done, *queues]
        try:
            mark = tombstone(request.id, request.retries)
            args = [task_id, DONE_KEEP_MS, mark, _consumer(request), "1" if redelivered else "0"]
            args.append(leases.get(group, 0))
            raw = _call(ext, _scripts.PARK_GATE, keys_, args, "admit a task")
            if int(raw) == ParkGateReply.PARKED and ext.store.engine.wait_replicas:
                # dropped for a park min_replicas may not have (its own, refused and requeued:
                # this is its redelivery): the gate again, WAIT covering the park (its write)
                raw = _call(ext, _scripts.PARK_GATE, keys_, args, "admit a task", "park_gate")
        except LeaseBackendError as exc:
            # not retried (self.retry): a gate that ran but whose reply was lost consumed the
            # hand-on for this message, which only this message, redelivered, passes again
            # (park_gate.lua records its consumer): requeue this one
            logger.error("leases: %s[%s] requeued: %s", task.name, request.id, exc)
            raise Reject(str(exc), requeue=True) from exc
        if int(raw) >= ParkGateReply.BEHIND:  # 4 + k: behind the group's k-th FIFO
            ahead = busy[group][int(raw) - ParkGateReply.BEHIND]
            # the first in the task's order: its leases, then its limits
            limited = isinstance(behind, RateLimited)
            if behind is None or (limited and not isinstance(ahead, RateLimited)):
                behind = ahead
            continue
        reply = ParkGateReply(int(raw))
        if reply == ParkGateReply.HANDED:
            logger.info("leases: %s[%s] handed on: runs", task.name, request.id)
            return True, None
        if reply == ParkGateReply.PARKED:
            logger.info("leases: %s[%s] is parked: this copy is dropped", task.name, request.id)
            raise Ignore()
        if reply == ParkGateReply.CONSUMED:
            ran = True  # unless handed on in another group: it parked again there since
    if ran:
        if getattr(request, PARKED_HEADER, None) is not None and redelivered:
            # a copy that started and died (the redelivery guard decides): if its lease is
            # busy (its dead run's, or taken since), it parks again as the consumer
            return True, None
        logger.info(
            "leases: %s[%s] already ran from its hand-on: this copy is dropped",
            task.name,
            request.id,
        )
        raise Ignore()
    return False, behind


def defer(
    ext: Leases,
    task: Any,
    busy: LeaseBusy,
    wants: Sequence[Want],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    consumed: bool,
    limits: Sequence[LimitWant] = (),
    force: bool = False,
) -> None:
    """Park the task on the busy resource (or the rate limit that refused it) and end this
    delivery (raise ``Ignore``). Returns only when the resource has room again (released
    meanwhile, or the limit admits): acquire again. ``force``: park on a lease even then (an
    earlier park of this delivery found room, and the acquire was refused again: by a restart
    grace or the waiter queue, which only the acquire sees); the pump hands it on after the
    wait the refusal told."""
    request = task.request
    limit = None
    if isinstance(busy, RateLimited):
        limit = next((w for w in limits if w.name == busy.resource), None)
    try:
        if limit is not None:
            code = _park_on_limit(ext, task, limit, args, kwargs, consumed)
            template = limit.template or "?"
            where = f"rate limit {limit.name}"
        else:
            want = next((w for w in wants if w.resource == busy.resource), wants[0])
            code = _park_on_lease(ext, task, want, args, kwargs, consumed, force, busy)
            template = _lease_template(task, want)
            where = want.resource
    except LeaseBackendError as exc:
        # not retried: a park that ran (its reply lost) or too few replicas confirmed stands
        # under this message's tombstone; a retry, another message, would run beside it.
        # Requeued, not acked: dropped while parked, parked again if the park is gone
        logger.error("leases: %s[%s] requeued: %s", task.name, request.id, exc)
        raise Reject(str(exc), requeue=True) from exc
    if code in (ParkReply.FREE, ParkReply.HANDED):
        return
    if code == ParkReply.PARKED:
        from ._unique import keep_queued  # _unique imports the task layer's modules

        if consumed:  # parked again: its hand-on's reservation on its other leases is no use
            _unreserve(ext, request.id, [w for w in wants if w.resource != where])
        keep_queued(ext, task, request.id)
        _parked_now(task, template)
        logger.info("leases: %s[%s] parked on %s", task.name, request.id, where)
        _mark_parked(request.id)
    else:
        logger.info(
            "leases: %s[%s] is parked or ran already: this copy is dropped",
            task.name,
            request.id,
        )
    raise Ignore()


def _unreserve(ext: Leases, task_id: str, wants: Sequence[Want]) -> None:
    """Free the reservations a hand-on made for ``task_id`` on ``wants`` and hand each freed
    resource on to its next parked task. Called once the task parked again elsewhere (after
    the park: a process killed before leaves the reservation to run out, as before). Never
    raises: a reservation not freed runs out after ``handon_timeout``.

    Timeline: t0 T (leases A and B) parked on A is handed A on (A reserved for T); t1 T's
    copy consumes the hand-on and finds B busy; t2 T parks on B; t3 here A's reservation
    goes and A is handed on to the next task parked on A, instead of A being held for nobody
    until t0 + handon_timeout. When B hands on to T, T acquires A again (or parks on it)."""
    keys = ext.store.keys
    holder = f"0 {PLACEHOLDER}{escape(task_id)}"
    for want in wants:
        _, _, _, due = _group_keys(ext, keys.group_of(want.resource))
        rkeys = [keys.exclusive(want.resource), keys.shared(want.resource), due]
        try:
            freed = _call(
                ext, _scripts.UNRESERVE, rkeys, [holder, _due_member(want)], "free a reservation"
            )
        except LeaseBackendError as exc:
            logger.error(
                "leases: could not free %s reserved for %s: %s", want.resource, task_id, exc
            )
            continue
        if int(freed):
            logger.info("leases: %s parked again: %s no longer reserved", task_id, want.resource)
            hand_on(ext, [want])


def _message(
    task: Any, resource: str, args: tuple[Any, ...], kwargs: dict[str, Any], on: str
) -> str:
    """The parked task's message: its signature, with its park generation as a header."""
    request = task.request
    generation = int(getattr(request, PARKED_HEADER, None) or 0) + 1
    headers = dict(getattr(request, "headers", None) or {})
    headers[PARKED_HEADER] = generation
    sig = task.signature_from_request(
        request, args, kwargs, retries=request.retries, headers=headers
    )
    record: dict[str, Any] = {"resource": resource, "task": task.name, "sig": dict(sig)}
    if on != "lease":
        record["on"] = on
    return str(dumps(record))


def _park_on_lease(
    ext: Leases,
    task: Any,
    want: Want,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    consumed: bool,
    force: bool,
    busy: LeaseBusy,
) -> ParkReply:
    """park.lua for the task on ``want`` (see :func:`defer`)."""
    request = task.request
    state, msgs, done, due = _group_keys(ext, ext.store.keys.group_of(want.resource))
    reply = _call(
        ext,
        _scripts.PARK,
        [
            ext.store.keys.exclusive(want.resource),
            ext.store.keys.shared(want.resource),
            ext.store.keys.parked(want.resource),
            state,
            msgs,
            done,
            due,
        ],
        [
            escape(request.id),
            want.mode,
            want.limit,
            _message(task, want.resource, args, kwargs, "lease"),
            _due_member(want),
            DONE_KEEP_MS,
            "1" if consumed else "0",
            tombstone(request.id, request.retries),
            "1" if force else "0",
            _ms(busy.retry_after or 0.001),
            _consumer(request),
            PLACEHOLDER,
        ],
        "park a task",
        wait="park",
    )
    return ParkReply(int(reply[0]))


def _rate_member(limit: LimitWant) -> str:
    """The due index's member of a rate limit's FIFO: ``"r <N>:<period us>:<cost> <name>"``."""
    return f"r {limit.n}:{limit.period_us}:{limit.cost} {limit.name}"


def _park_on_limit(
    ext: Leases,
    task: Any,
    limit: LimitWant,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    consumed: bool,
) -> ParkReply:
    request = task.request
    state, msgs, done, due = _group_keys(ext, ext.store.keys.group_of(limit.name))
    reply = _call(
        ext,
        _scripts.PARK_LIMIT,
        [*_limit_script_keys(ext, limit.name), state, msgs, done, due],
        [
            escape(request.id),
            limit.n,
            limit.period_us,
            limit.cost,
            _message(task, limit.name, args, kwargs, "limit"),
            _rate_member(limit),
            DONE_KEEP_MS,
            "1" if consumed else "0",
            tombstone(request.id, request.retries),
            _consumer(request),
        ],
        "park a task on a rate limit",
        wait="park_limit",
    )
    return ParkReply(int(reply[0]))


#: called with (task name, lease template) for each task parked in this process: the metrics
parked_observers: list[Callable[[str, str], None]] = []


def _lease_template(task: Any, want: Want) -> str:
    """The template of the lease ``want`` was rendered from (the metrics label)."""
    for t in getattr(task, "_lease_templates", ()):
        if t.mode == ("x" if want.mode == "x" else "s") and t.limit == want.limit:
            return str(t.text)
    return "?"


def _parked_now(task: Any, template: str) -> None:
    """Tell the observers: labelled by the template, never the rendered resource."""
    for observe in tuple(parked_observers):
        try:
            observe(str(task.name), template)
        except Exception:
            logger.exception("leases: a parked-task observer failed")


# --- which deliveries ended parked (for the redelivery guard's completion record) -----------
_parked_ids: set[str] = set()
_parked_lock = threading.Lock()


def _mark_parked(task_id: str) -> None:
    with _parked_lock:
        _parked_ids.add(task_id)


def ended_parked(task_id: str) -> bool:
    """True once for a delivery of ``task_id`` that ended parked in this process."""
    with _parked_lock:
        if task_id in _parked_ids:
            _parked_ids.discard(task_id)
            return True
        return False


# --- the releaser's side and the pump -------------------------------------------------------
def hand_on(ext: Leases, wants: Iterable[Want]) -> int:
    """Hand each resource of ``wants`` on to the head of its parked FIFO while it has room;
    returns how many tasks were published again. Never raises for Redis or broker trouble:
    a hand-on not published runs out and is handed on again (the pump)."""
    count = 0
    for want in wants:
        for _ in range(_MAX_HANDONS):
            try:
                if not _hand_on_one(ext, want.resource, want.mode, want.limit):
                    break
            except LeaseBackendError as exc:
                logger.error("leases: could not hand on %s: %s", want.resource, exc)
                break
            count += 1
    return count


def hand_on_released(ext: Leases, resources: Iterable[str]) -> int:
    """Hand on ``resources`` released outside a task (``Leases.release``, ``hold()``): the
    mode and limit of each come from what its parked tasks recorded. Never raises."""
    store = ext.store
    count = 0
    for resource in dict.fromkeys(resources):
        msgs = store.keys.park_messages(store.keys.group_of(resource))
        try:
            member = store.client.hget(msgs, "%r" + resource)
        except RedisError as exc:
            logger.error("leases: could not hand on %s: %s", resource, exc)
            continue
        if member is None:
            continue
        mode, limit, _ = _text(member).split(" ", 2)
        want = Want(resource, "x" if mode == "x" else "s", int(limit))
        count += hand_on(ext, [want])
    return count


async def ahand_on_released(ext: Leases, resources: Iterable[str]) -> int:
    """:func:`hand_on_released` for asyncio (``Leases.arelease``, ``ahold()``): the same
    hand-ons, run in a worker thread, as the publish goes through the app's (blocking)
    producer. A cancelled caller does not stop them: the thread runs them to the end."""
    return await asyncio.to_thread(hand_on_released, ext, list(resources))


def parks(ext: Leases) -> bool:
    """True if ``ext``'s releases hand on (:func:`parking_used`, looked up once per Leases)."""
    known = ext._parking
    if known is None:
        known = ext._parking = parking_used(ext.app)
    return known


def parking_used(app: Any) -> bool:
    """True if a task of ``app`` (or its ``on_busy`` setting) defers, or is unique (a send
    of it may be keep_last or debounce, declared or per call): then its releases hand on and
    its workers run the pump."""
    from .config import get_settings

    if get_settings(app).on_busy == "defer":
        return True
    return any(
        getattr(t, "on_busy", None) == "defer" or getattr(t, "_unique_template", None) is not None
        for t in list(app.tasks.values())
    )


def _registered(ext: Leases) -> str:
    """The owner id of this process, registered under its node (and in the owners index) so
    that a cleanup of it reads the registry where its hand-ons are recorded. A process that
    holds no lease (a worker's main process running the pump) was never registered, or was
    forgotten by a reconcile once its liveness ran out: then the owner's home call first, as
    a grant outside the home group does (see _claims.py)."""
    store = ext.store
    engine = store.engine
    ident = ext.identity()
    if not engine.liveness_covers(ident.owner, 0.0):
        home = store.run(acquire_group(engine, 0, [], ident, ext.settings.ttl, True))
        if isinstance(home, Busy):  # restart grace: Redis restarted; hand on unrecorded
            logger.debug("leases: could not register %s before a hand-on", ident.owner)
    return ident.owner


def _hand_on_one(ext: Leases, resource: str, mode: str, limit: int) -> bool:
    keys = ext.store.keys
    group = keys.group_of(resource)
    _, msgs, _, due = _group_keys(ext, group)
    state = keys.park_state(group)
    settings = ext.settings
    registry = ext.store.engine.registry_key(_registered(ext), group)
    reply = _call(
        ext,
        _scripts.HANDON,
        [
            keys.exclusive(resource),
            keys.shared(resource),
            keys.parked(resource),
            state,
            msgs,
            due,
            registry,
        ],
        [
            mode,
            limit,
            _ms(settings.handon_timeout),
            f"{mode} {limit} {resource}",
            PLACEHOLDER,
            # the record outlives the reservation by a ttl: a cleanup of this process when
            # it dies comes within that (its reaper, its restart, a reconcile)
            _ms(settings.handon_timeout + settings.ttl),
        ],
        "hand on a parked task",
    )
    if int(reply[0]) != 1:
        return False
    task_id = unescape(_text(reply[1]))
    _die_here_for_a_test()
    if _publish(ext, task_id, _text(reply[2])):
        logger.info("leases: handed %s on to %s", resource, task_id)
    _forget_record(ext, registry, reply[3])
    return True


def _forget_record(ext: Leases, registry: str, entry: object) -> None:
    """Published (or given up): a cleanup of this process has nothing to take over."""
    try:
        ext.store.client.srem(registry, _text(entry))
    except RedisError as exc:
        logger.error("leases: could not remove the record of a hand-on: %s", exc)


def _publish(ext: Leases, task_id: str, raw: str) -> bool:
    """Publish a parked task's message again; False (logged) if that failed or it has no
    message: its reservation then runs out unclaimed, the task goes back to its FIFO and is
    handed on again in its turn. Never raises."""
    if not raw:
        logger.warning("leases: parked task %s has no message; left to its redelivery", task_id)
        return False
    try:
        record = loads(raw)
        # a keep_last follow-up's message has no id of its own: it is the parked task's
        record["sig"].setdefault("options", {}).setdefault("task_id", task_id)
        ext.app.signature(record["sig"]).apply_async()
    except Exception:
        logger.exception("leases: could not publish parked task %s", task_id)
        return False
    return True


def _hand_on_limit(ext: Leases, spec: str, name: str, soonest: list[float] | None) -> int:
    """Hand the rate limit ``name``'s FIFO on while the limit has room (up to
    ``_MAX_HANDONS``; ``spec`` is ``"<N>:<period us>:<cost>"`` of the due member); returns
    how many tasks were published again. Appends to ``soonest`` when it next has room."""
    keys = ext.store.keys
    group = keys.group_of(name)
    _, msgs, _, due = _group_keys(ext, group)
    state = keys.park_state(group)
    settings = ext.settings
    registry = ext.store.engine.registry_key(_registered(ext), group)
    n, period_us, cost = spec.split(":")
    count = 0
    for _ in range(_MAX_HANDONS):
        reply = _call(
            ext,
            _scripts.HANDON_LIMIT,
            [*_limit_script_keys(ext, name), state, msgs, due, registry],
            [
                n,
                period_us,
                cost,
                _ms(settings.handon_timeout),
                f"r {spec} {name}",
                _ms(settings.handon_timeout + settings.ttl),  # as _hand_on_one's record
            ],
            "hand on a task parked on a rate limit",
        )
        if int(reply[0]) != 1:
            if soonest is not None and int(reply[1]) > 0:
                soonest.append(int(reply[1]) / 1000)
            break
        task_id = unescape(_text(reply[1]))
        _die_here_for_a_test()
        if _publish(ext, task_id, _text(reply[2])):
            logger.info("leases: handed rate limit %s on to %s", name, task_id)
        _forget_record(ext, registry, reply[3])
        count += 1
    return count


def publish_taken_over(ext: Leases, report: CleanupReport) -> int:
    """Publish the hand-ons a cleanup took over from dead owners (``report.handons``);
    returns how many were published. Never raises."""
    count = 0
    for owner, task_id, raw in report.handons:
        if _publish(ext, task_id, raw):
            logger.info("leases: took over the hand-on to %s of dead owner %s", task_id, owner)
            count += 1
    return count


#: environment variable of the fault tests: the path of a file; the first hand-on that finds
#: it deletes it and kills its process (SIGKILL) between the reservation and the publish
DIE_BEFORE_PUBLISH_ENV: Final = "CELERY_LEASES_TEST_DIE_BEFORE_PUBLISH"


def _die_here_for_a_test() -> None:
    path = os.environ.get(DIE_BEFORE_PUBLISH_ENV)
    if not path:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return  # another hand-on took it
    logger.warning("leases: %s: killed between a hand-on and its publish", DIE_BEFORE_PUBLISH_ENV)
    os.kill(os.getpid(), signal.SIGKILL)


def pump(ext: Leases, soonest: list[float] | None = None) -> int:
    """One turn of the park pump: each resource whose due time came, in every slot group, is
    handed on once (one head per resource and turn: round robin), and each rate limit as
    often as its window has room. Returns how many tasks were published again; appends to
    ``soonest`` the seconds until each rate limit looked at has room again (the worker turns
    the pump then, when that is sooner than its interval)."""
    store = ext.store
    count = 0
    for group in range(store.keys.slot_groups):
        due = store.keys.park_due(group)
        try:
            now = store.redis_time()
            members = store.client.zrangebyscore(due, "-inf", now * 1000, 0, _PUMP_BATCH)
        except (RedisError, LeaseBackendError) as exc:
            logger.error("leases: the parking pump could not read its due index: %s", exc)
            continue
        for raw in members:
            mode, limit, resource = _text(raw).split(" ", 2)
            try:
                if mode == "r":  # a rate limit's FIFO: as many as its window has room for
                    count += _hand_on_limit(ext, limit, resource, soonest)
                elif _hand_on_one(ext, resource, mode, int(limit)):
                    count += 1
            except LeaseBackendError as exc:
                logger.error("leases: could not hand on %s: %s", resource, exc)
    return count
