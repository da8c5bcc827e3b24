"""Unique modes (``unique_mode``, docs/unique.md "Modes"): what a send of a unique task does
while its key is taken, checked at declaration and per send; keep_last's messages and newest
arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from celery.utils.log import get_logger
from kombu.utils.json import dumps, loads
from redis.exceptions import RedisError

from ._claims import ClaimMode
from ._keys import UNIQUE_PREFIX, escape
from ._parking import PARKED_HEADER
from .exceptions import LeaseConfigError

if TYPE_CHECKING:
    from ._unique import UniqueTask
    from .app import Leases

__all__ = ("MODE_HEADER", "UNIQUE_HEADER", "UniqueMode", "check_mode", "newest_arguments")

logger = get_logger(__name__)

#: message header carrying the unique key the producer claimed (the worker takes over exactly
#: that key, whatever its own rendering of the arguments after serialisation would give)
UNIQUE_HEADER: Final = "lease_unique"
#: message header of a keep_last send (a per-call unique_mode too): its run reads the newest
#: arguments sent for it, and its follow-up's hand-on is consumed as it starts
MODE_HEADER: Final = "lease_unique_mode"
#: what a send does while the key is taken (docs/unique.md, "Modes")
UniqueMode = Literal["refuse", "throttle", "replace", "keep_last"]
#: options of a send kept in a keep_last follow-up's message (published when it is due)
_KEPT_OPTIONS: Final = (
    "queue",
    "routing_key",
    "exchange",
    "priority",
    "expires",
    "time_limit",
    "soft_time_limit",
    "serializer",
    "shadow",
)


def check_mode(
    name: str, unique: object, mode: object, window: object, on_duplicate: object = None
) -> None:
    """Check a task's (or one send's) ``unique_mode``/``unique_window`` (and that its
    ``on_duplicate`` means something with that mode).

    Raises:
        LeaseConfigError: naming the task and the option that is wrong.
    """
    allowed = get_args(UniqueMode)
    if mode is not None and mode not in allowed:
        msg = f"task {name!r}: unique_mode={mode!r} is not one of {', '.join(allowed)}"
        raise LeaseConfigError(msg)
    if unique is None and (mode is not None or window is not None):
        option = "unique_mode=" if mode is not None else "unique_window="
        msg = f"task {name!r}: {option} needs unique= (the key it applies to)"
        raise LeaseConfigError(msg)
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0
    ):
        msg = f"task {name!r}: unique_window={window!r} must be a number of seconds > 0"
        raise LeaseConfigError(msg)
    if mode == "throttle" and window is None:
        msg = f"task {name!r}: unique_mode='throttle' needs unique_window= (seconds)"
        raise LeaseConfigError(msg)
    if mode != "throttle" and window is not None:
        msg = (
            f"task {name!r}: unique_window= means nothing with unique_mode={mode or 'refuse'!r}"
            " (it is the window of unique_mode='throttle')"
        )
        raise LeaseConfigError(msg)
    if mode == "keep_last" and on_duplicate is not None:
        msg = (
            f"task {name!r}: on_duplicate= means nothing with unique_mode='keep_last' (a send "
            "is never refused: its arguments go to the run that will carry them)"
        )
        raise LeaseConfigError(msg)


def header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        raw = getattr(request, "headers", None)
        if isinstance(raw, Mapping):
            value = raw.get(name)
    return value


def claim_mode(
    task: UniqueTask, per_call: tuple[object, object, object], queue_ttl: float
) -> ClaimMode:
    """The :class:`ClaimMode` of one send: the task's ``unique_mode``/``unique_window``, or
    the send's own (``apply_async`` options, a beat entry's ``options``), checked here."""
    on_duplicate, mode, window = per_call
    if mode is not None or window is not None or on_duplicate is not None:
        mode = task.unique_mode if mode is None else mode
        if window is None and mode == "throttle":
            window = task.unique_window
        check_mode(task.name, task.unique, mode, window, on_duplicate)
    else:
        mode, window = task.unique_mode, task.unique_window
    if mode == "throttle":
        return ClaimMode(window=float(window), forget=queue_ttl)  # type: ignore[arg-type]
    if mode == "keep_last":
        return ClaimMode(forget=queue_ttl, message="")
    return ClaimMode(replace=mode == "replace", forget=queue_ttl)


def kept(
    mode: ClaimMode, key: str, name: str, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> ClaimMode:
    """``mode`` with the send as the message of a keep_last follow-up (_parking.py's format,
    without a task id: the hand-on gives it the id of the run it is)."""
    kept = {k: options[k] for k in _KEPT_OPTIONS if options.get(k) is not None}
    headers = dict(options.get("headers") or {})
    headers.update({UNIQUE_HEADER: key, PARKED_HEADER: 1, MODE_HEADER: "keep_last"})
    sig = {
        "task": name,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": {**kept, "headers": headers},
        "subtask_type": None,
        "immutable": False,
    }
    try:
        message = dumps({"resource": UNIQUE_PREFIX + key, "task": name, "sig": sig})
    except (TypeError, ValueError) as exc:
        msg = f"task {name!r}: unique_mode='keep_last' needs JSON arguments: {exc}"
        raise LeaseConfigError(msg) from exc
    return ClaimMode(forget=mode.forget, message=message)


def handed_on(task: UniqueTask, mode: object, options: Mapping[str, Any]) -> bool:
    """True for the publish of a keep_last follow-up by its hand-on (_parking.py)."""
    headers = options.get("headers") or {}
    keep_last = (mode or task.unique_mode) == "keep_last" or headers.get(MODE_HEADER) == "keep_last"
    return keep_last and bool(headers.get(PARKED_HEADER)) and bool(headers.get(UNIQUE_HEADER))


def keeps_last(task: Any, request: Any) -> bool:
    """True for a run of a keep_last task (declared so, or sent with the per-call option)."""
    return bool(task.unique_mode == "keep_last" or header(request, MODE_HEADER) == "keep_last")


def newest_arguments(
    ext: Leases, task: Any, task_id: str, args: Any, kwargs: Any, wants: Any
) -> tuple[Any, Any, Any]:
    """``(args, kwargs, wants)`` a keep_last run runs with: the newest a later send gave it
    while it was queued (read once its claim is taken: no send writes them after), else its
    own. ``wants`` (its leases) are rendered again from newer arguments."""
    if not keeps_last(task, task.request):
        return args, kwargs, wants
    store = ext.store
    resource = UNIQUE_PREFIX + header(task.request, UNIQUE_HEADER)
    newest = store.keys.unique_newest(resource)
    try:
        raw = store.client.hget(newest, escape(task_id))
        if raw is None:
            return args, kwargs, wants
        store.client.hdel(newest, escape(task_id))
    except RedisError as exc:
        logger.error("leases: %s[%s] runs with its own arguments: %s", task.name, task_id, exc)
        return args, kwargs, wants
    sig = loads(raw.decode() if isinstance(raw, bytes) else raw)["sig"]
    args, kwargs = tuple(sig.get("args") or ()), dict(sig.get("kwargs") or {})
    logger.info("leases: %s[%s] runs with the newest arguments sent", task.name, task_id)
    return args, kwargs, task._render_leases(args, kwargs)
