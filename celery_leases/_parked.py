"""Parked tasks' keys, script calls and the operators' side: list, count, cancel (_parking.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from celery.utils.log import get_logger
from kombu.utils.json import loads
from redis.exceptions import RedisError

from . import _scripts
from ._keys import escape, unescape
from ._protocol import Failure, ReplicaShortfall

if TYPE_CHECKING:
    from .app import Leases

__all__ = (
    "DONE_KEEP_MS",
    "Parked",
    "list_parked",
    "parked_counts",
    "tombstone",
    "unpark",
)

logger = get_logger(__name__)

#: milliseconds a consumed hand-on's tombstone is kept: a later copy of the task is dropped
DONE_KEEP_MS: Final = 7 * 24 * 3600 * 1000


class Parked(dict[str, Any]):
    """One parked task as ``celery leases parked`` shows it (a dict: JSON as it is)."""


def _call(
    ext: Leases, src: str, keys: Sequence[str], args: Sequence[Any], what: str, wait: str = ""
) -> Any:
    """One script call; ``wait``: its name, to follow it with ``WAIT`` for ``min_replicas``
    (if set) as a grant does (a park: its message is acked once this returns)."""
    store = ext.store
    try:
        if wait and store.engine.wait_replicas:
            return store.run(store.engine.replicated(wait, keys, args, what))
        return store.client.register_script(src)(keys=list(keys), args=list(args))
    except (RedisError, Failure, ReplicaShortfall) as exc:
        raise store.backend_error(what, exc) from exc


def _group_keys(ext: Leases, group: int) -> tuple[str, str, str, str]:
    keys = ext.store.keys
    return (
        keys.park_state(group),
        keys.park_messages(group),
        keys.park_done(group),
        keys.park_due(group),
    )


def tombstone(task_id: str, retries: int | None) -> str:
    """The done ZSET's member of a consumed hand-on: per message, so a retry is not one."""
    return f"{escape(task_id)}#{int(retries or 0)}"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _limit_script_keys(ext: Leases, name: str) -> list[str]:
    keys = ext.store.keys
    log, state, override, penalty, _ = keys.limit_keys(name)
    return [log, state, override, penalty, keys.parked_limit(name)]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- operators ------------------------------------------------------------------------------
def list_parked(ext: Leases, resource: str | None = None) -> list[Parked]:
    """The parked tasks (of ``resource``, or all), in each resource's FIFO order."""
    store = ext.store
    client = store.client
    out: list[Parked] = []
    try:
        groups = (
            [store.keys.group_of(resource)]
            if resource is not None
            else list(range(store.keys.slot_groups))
        )
        for group in groups:
            state, msgs, _, _ = _group_keys(ext, group)
            states = {_text(k): _text(v) for k, v in client.hgetall(state).items()}
            for key, raw in client.hgetall(msgs).items():
                task_id = _text(key)
                if task_id.startswith("%"):
                    continue  # "%r<resource>": a resource's due member (park.lua)
                record = loads(_text(raw))
                if resource is not None and record.get("resource") != resource:
                    continue
                on = record.get("on", "lease")
                handed = states.get(task_id) == "h"
                since = client.zscore(_fifo(ext, record), task_id)
                out.append(
                    Parked(
                        task_id=unescape(task_id),
                        task=record.get("task"),
                        resource=record.get("resource"),
                        on=on,
                        state="handed on" if handed else "parked",
                        # a rate limit's hand-on is scored by when it runs out
                        since=0.0 if handed and on == "limit" else (since or 0) / 1e6,
                    )
                )
    except RedisError as exc:
        raise store.backend_error("list parked tasks", exc) from exc
    out.sort(key=lambda p: (p["resource"], p["since"]))
    return out


def _fifo(ext: Leases, record: dict[str, Any]) -> str:
    """The FIFO a parked task's record says it waits in: its lease's or its rate limit's."""
    keys = ext.store.keys
    if record.get("on") == "limit":
        return keys.parked_limit(record["resource"])
    return keys.parked(record["resource"])


def parked_counts(ext: Leases) -> dict[str, int]:
    """Resource -> how many tasks are parked on it (the web view)."""
    counts: dict[str, int] = {}
    for p in list_parked(ext):
        counts[p["resource"]] = counts.get(p["resource"], 0) + 1
    return counts


def unpark(ext: Leases, task_id: str) -> bool:
    """Cancel the parked task ``task_id``: it leaves its FIFO, a copy already published is
    dropped, and its result becomes REVOKED. False if it was not parked."""
    store = ext.store
    escaped = escape(task_id)
    for group in range(store.keys.slot_groups):
        state, msgs, done, _ = _group_keys(ext, group)
        try:
            raw = store.client.hget(msgs, escaped)
        except RedisError as exc:
            raise store.backend_error("find a parked task", exc) from exc
        if raw is None:
            continue
        record = loads(_text(raw))
        keys = [state, msgs, done, _fifo(ext, record)]
        mark = tombstone(task_id, record.get("sig", {}).get("options", {}).get("retries"))
        args = [escaped, DONE_KEEP_MS, mark]
        if int(_call(ext, _scripts.UNPARK, keys, args, "unpark a task")):
            try:
                ext.app.backend.mark_as_revoked(task_id, "unparked")
            except Exception:
                logger.exception("leases: could not mark unparked task %s REVOKED", task_id)
            return True
    return False
