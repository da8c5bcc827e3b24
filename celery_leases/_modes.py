"""Unique modes (``unique_mode``, docs/unique.md "Modes"): what a send of a unique task does
while its key is taken, checked at declaration and per send; keep_last's messages and newest
arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
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
#: the per-call options of a unique mode (apply_async, send_task, a beat entry's options)
PER_CALL: Final = ("unique_mode", "unique_window", "unique_max_wait")
#: the MODE_HEADER of a message that a send parked as a follow-up (keep_last, debounce, and
#: on_duplicate="cancel"): its run takes the hand-on and the newest arguments sent for it
_FOLLOWING: Final = ("keep_last", "debounce", "cancel")
#: the unique modes that take on_duplicate="cancel" (the others never refuse a running copy
#: with on_duplicate, or, throttle, refuse every send while the window runs)
CANCELS: Final = (None, "refuse", "replace")
#: debounce without unique_max_wait: the latest a burst's run may be, seconds (30 years)
_NO_MAX_WAIT: Final = 1e9
#: what a send does while the key is taken (docs/unique.md, "Modes")
UniqueMode = Literal["refuse", "throttle", "replace", "keep_last", "debounce"]
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


def _seconds(name: str, option: str, value: object) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        msg = f"task {name!r}: {option}={value!r} must be a number of seconds > 0"
        raise LeaseConfigError(msg)


def check_mode(
    name: str,
    unique: object,
    mode: object,
    window: object,
    on_duplicate: object = None,
    max_wait: object = None,
) -> None:
    """Check a task's (or one send's) ``unique_mode``, ``unique_window`` and
    ``unique_max_wait`` (and that its ``on_duplicate`` means something with that mode).

    Raises:
        LeaseConfigError: naming the task and the option that is wrong.
    """
    allowed = get_args(UniqueMode)
    if mode is not None and mode not in allowed:
        msg = f"task {name!r}: unique_mode={mode!r} is not one of {', '.join(allowed)}"
        raise LeaseConfigError(msg)
    given = [o for o, v in (("mode", mode), ("window", window), ("max_wait", max_wait)) if v]
    if unique is None and given:
        msg = f"task {name!r}: unique_{given[0]}= needs unique= (the key it applies to)"
        raise LeaseConfigError(msg)
    _seconds(name, "unique_window", window)
    _seconds(name, "unique_max_wait", max_wait)
    timed = mode in ("throttle", "debounce")
    if timed and window is None:
        msg = f"task {name!r}: unique_mode={mode!r} needs unique_window= (seconds)"
        raise LeaseConfigError(msg)
    if not timed and window is not None:
        msg = (
            f"task {name!r}: unique_window= means nothing with unique_mode={mode or 'refuse'!r}"
            " (it is the window of unique_mode='throttle' or 'debounce')"
        )
        raise LeaseConfigError(msg)
    if max_wait is not None and mode != "debounce":
        msg = (
            f"task {name!r}: unique_max_wait= means nothing with unique_mode="
            f"{mode or 'refuse'!r} (it is for unique_mode='debounce')"
        )
        raise LeaseConfigError(msg)
    if max_wait is not None and max_wait < window:  # type: ignore[operator]
        msg = (
            f"task {name!r}: unique_max_wait={max_wait!r} is less than unique_window="
            f"{window!r}: a run could never wait for a quiet window"
        )
        raise LeaseConfigError(msg)
    if on_duplicate == "cancel" and mode not in CANCELS:
        msg = (
            f"task {name!r}: on_duplicate='cancel' is for unique_mode='refuse' or 'replace', "
            f"not {mode!r}"
        )
        raise LeaseConfigError(msg)
    if mode in ("keep_last", "debounce") and on_duplicate is not None:
        msg = (
            f"task {name!r}: on_duplicate= means nothing with unique_mode={mode!r} (a send "
            "is never refused: its arguments go to the run that will carry them)"
        )
        raise LeaseConfigError(msg)


def check_unique_options(name: str, unique: object, deadline: object, confirm: object) -> None:
    """Check a task's ``unique_cancel_deadline`` and ``unique_confirm`` options.

    Raises:
        LeaseConfigError: naming the task and the option that is wrong.
    """
    _seconds(name, "unique_cancel_deadline", deadline)
    if confirm is not None and not isinstance(confirm, bool):
        msg = f"task {name!r}: unique_confirm={confirm!r} must be True or False"
        raise LeaseConfigError(msg)
    given = [o for o, v in (("cancel_deadline", deadline), ("confirm", confirm)) if v is not None]
    if unique is None and given:
        msg = f"task {name!r}: unique_{given[0]}= needs unique= (the key it applies to)"
        raise LeaseConfigError(msg)


def check_beat_entries(sender: Any = None, **kwargs: Any) -> None:
    """At beat start: check the unique modes in the options of each ``beat_schedule``
    entry, logging each bad one at ERROR (a ``beat_init`` receiver cannot stop beat; the
    entry's sends are refused with the same error)."""
    app = getattr(sender, "app", None)
    schedule = getattr(getattr(app, "conf", None), "beat_schedule", None) or {}
    for name, entry in dict(schedule).items():
        options = dict(entry.get("options") or {})
        given = [options.get(o) for o in ("on_duplicate", *PER_CALL)]
        task = app.tasks.get(entry.get("task")) if app is not None else None
        try:
            if task is not None and getattr(task, "_unique_template", None) is not None:
                claim_mode(task, tuple(given), 0.0)
            elif any(v is not None for v in given[1:]):
                check_mode(str(entry.get("task")), None, given[1], given[2], None, given[3])
        except LeaseConfigError as exc:
            logger.error("leases: beat entry %r is refused at each send: %s", name, exc)


def header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        raw = getattr(request, "headers", None)
        if isinstance(raw, Mapping):
            value = raw.get(name)
    return value


def claim_mode(task: UniqueTask, per_call: tuple[object, ...], queue_ttl: float) -> ClaimMode:
    """The :class:`ClaimMode` of one send: the task's ``unique_mode``, ``unique_window`` and
    ``unique_max_wait``, or the send's own (``apply_async`` options, a beat entry's
    ``options``), checked here."""
    on_duplicate, mode, window, max_wait = per_call
    if any(v is not None for v in per_call):
        if mode is None or mode == task.unique_mode:
            mode = task.unique_mode
            window = task.unique_window if window is None else window
            max_wait = task.unique_max_wait if max_wait is None else max_wait
        check_mode(task.name, task.unique, mode, window, on_duplicate, max_wait)
    else:
        mode, window, max_wait = task.unique_mode, task.unique_window, task.unique_max_wait
    if mode == "throttle":
        return ClaimMode(window=float(window), forget=queue_ttl)  # type: ignore[arg-type]
    if mode == "debounce":
        wait = float(max_wait or _NO_MAX_WAIT)  # type: ignore[arg-type]
        return ClaimMode("d", forget=queue_ttl, quiet=float(window), max_wait=wait)  # type: ignore[arg-type]
    letter = {"keep_last": "k", "replace": "r"}.get(str(mode), "")
    return ClaimMode(letter, forget=queue_ttl)


def parked_kind(mode: ClaimMode) -> str | None:
    """The mode whose sends are parked messages (keep_last, debounce), else None."""
    return {"k": "keep_last", "d": "debounce"}.get(mode.kind)


def kept(
    mode: ClaimMode, key: str, name: str, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> ClaimMode:
    """``mode`` with the send as the message of a keep_last follow-up (_parking.py's format,
    without a task id: the hand-on gives it the id of the run it is); the follow-up of a
    cancel too (``mode.cancel``)."""
    kind = parked_kind(mode) or ("cancel" if mode.cancel else None)
    kept = {k: options[k] for k in _KEPT_OPTIONS if options.get(k) is not None}
    headers = dict(options.get("headers") or {})
    headers.update({UNIQUE_HEADER: key, PARKED_HEADER: 1, MODE_HEADER: kind})
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
        what = f"unique_mode={kind!r}" if parked_kind(mode) else "on_duplicate='cancel'"
        msg = f"task {name!r}: {what} needs JSON arguments: {exc}"
        raise LeaseConfigError(msg) from exc
    return replace(mode, message=message)


def handed_on(task: UniqueTask, mode: object, options: Mapping[str, Any]) -> bool:
    """True for the publish of a keep_last (or cancel) follow-up by its hand-on (_parking.py)."""
    headers = options.get("headers") or {}
    keep_last = (mode or task.unique_mode) in _FOLLOWING or headers.get(MODE_HEADER) in _FOLLOWING
    return keep_last and bool(headers.get(PARKED_HEADER)) and bool(headers.get(UNIQUE_HEADER))


def keeps_last(task: Any, request: Any) -> bool:
    """True for a run of a keep_last or debounce task (declared so, or sent so per call), and
    for a cancel's follow-up."""
    return bool(task.unique_mode in _FOLLOWING or header(request, MODE_HEADER) in _FOLLOWING)


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
