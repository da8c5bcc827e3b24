"""What a request's outcome means to its caller: Lease objects, log lines and signals."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from celery.result import AsyncResult
from celery.utils.log import get_logger

from . import signals
from ._lease import Held, Lease, Want, held_of
from .exceptions import LeaseBusy

if TYPE_CHECKING:
    from ._identity import Identity
    from ._sync.driver import LeaseStore


#: the log lines of acquire and release keep the logger of Leases (users filter on it)
logger = get_logger("celery_leases.app")


#: the one key of the result of a task skipped by ``on_busy="skip"`` (see :func:`is_skipped`)
SKIPPED_KEY: Final = "celery_leases.skipped"


def is_skipped(result: object) -> bool:
    """True if ``result`` is that of a task skipped by ``on_busy="skip"``.

    A skipped task ends SUCCESS without running its body; its result is a small dict,
    ``{"celery_leases.skipped": {"resource": ..., "holder_task": ...}}`` (JSON-safe, so it
    crosses any result backend), unless the ``skip_result`` setting is ``"none"``. ::

        result = build_report.delay(42)
        if is_skipped(result.get()):
            ...  # another copy held the report's lease

    Args:
        result: a task's return value, or its ``AsyncResult`` (a finished one is read
            without waiting; an unfinished one is not skipped yet).

    .. versionadded:: 0.1
    """
    if isinstance(result, AsyncResult):
        if not result.successful():
            return False
        result = result.result
    return isinstance(result, dict) and len(result) == 1 and SKIPPED_KEY in result


def busy_seen(
    busy: LeaseBusy, wants: Sequence[Want], ttl: float, task_id: str | None, elapsed: float
) -> None:
    # DEBUG: what the busy leads to (a task's retry, skip or failure, or LeaseBusy to the
    # caller of hold) is logged or raised once, by whoever decides it
    logger.debug(
        "leases: %s is busy: %s; its holder runs out in %.1fs unless it renews",
        busy.resource,
        busy,
        busy.retry_after or 0,
    )
    want = next((w for w in wants if w.resource == busy.resource), None)
    send_signal(
        signals.lease_busy,
        busy.resource,
        retry_after=busy.retry_after,
        task_id=task_id,
        elapsed=elapsed,
        shared=want is not None and want.mode == "s",
        ttl=ttl,
    )


def held_here(
    busy: LeaseBusy,
    wants: Sequence[Want],
    ident: Identity,
    store: LeaseStore,
    held: Sequence[Held],
) -> bool:
    """True if the busy resource is held by the asking process itself (same owner, same
    prefix) in a way that alone makes it busy: a nested hold, which leases do not let
    through (they are not reentrant). A full shared limit, where its own shared lease is
    only one of the holders, is not counted."""
    if busy.same_owner:
        return False
    asked = [w for w in wants if w.resource == busy.resource]
    if not asked:
        return False
    exclusive = asked[0].mode != "s"
    prefix = store.keys.prefix
    return any(
        h.resource == busy.resource
        and h.owner == ident.owner
        and h.engine.keys.prefix == prefix
        and (exclusive or h.mode != "s")
        for h in held
    )


def same_owner_busy(busy: LeaseBusy) -> LeaseBusy:
    """``busy`` told as what it is: this owner already holds the resource."""
    return LeaseBusy(
        busy.resource,
        retry_after=busy.retry_after,
        waited=busy.waited,
        holder_task=busy.holder_task,
        same_owner=True,
    )


def granted_leases(
    granted: Sequence[Held],
    ttl: float,
    task_id: str | None,
    on_lost: Callable[[Held], None] | None,
    elapsed: float,
) -> list[Lease]:
    """The Leases of fresh grants (already being renewed); logs and signals each."""
    leases = []
    # asked once per call, not per lease: a worker at -l warning logs neither line
    info = logger.isEnabledFor(logging.INFO)
    debug = info and logger.isEnabledFor(logging.DEBUG)
    for held in granted:
        if on_lost is not None:
            held.on_lost.append(on_lost)
        lease = Lease(held.resource, held.token, held.ttl, held.mode == "s", held)
        leases.append(lease)
        if info:
            logger.info("leases: acquired %s for %.1fs", held.resource, ttl)
        if debug:
            logger.debug("leases: %s token %d owner %s", held.resource, held.token, held.owner)
        if signals.lease_acquired.receivers:  # no receivers: not even the arguments are built
            send_signal(
                signals.lease_acquired,
                held.resource,
                token=held.token,
                owner=held.owner,
                ttl=ttl,
                shared=held.mode == "s",
                task_id=task_id,
                elapsed=elapsed,
            )
    return leases


def to_release(
    leases: Sequence[Lease], discard: Callable[[Held], None]
) -> tuple[list[Lease], list[Lease], float]:
    """``(leases to give back now, leases found lost, when)``; marks them released.

    ``when`` (monotonic) is the one clock read of the loss checks; it is also when the
    release began (``lease_released``'s ``elapsed``), so that costs no clock read more.
    """
    todo: list[Lease] = []
    lost: list[Lease] = []
    now = time.monotonic()
    for lease in leases:
        held = held_of(lease)
        discard(held)
        was_lost = held.is_lost(now)
        if not held.mark_released():
            continue
        if was_lost:
            lost.append(lease)
        todo.append(lease)
    return todo, lost, now


def released_leases(
    todo: list[Lease], freed: Sequence[bool], lost: list[Lease], asked: float
) -> list[Lease]:
    """Log and signal the release of ``todo``; returns ``lost`` and those found not held."""
    now = time.monotonic()
    info = logger.isEnabledFor(logging.INFO)
    for lease, ok in zip(todo, freed, strict=True):
        held = held_of(lease)
        if not ok and lease not in lost:
            lost.append(lease)
        if info:
            logger.info("leases: released %s", held.resource)
        if signals.lease_released.receivers:
            send_signal(
                signals.lease_released,
                held.resource,
                token=held.token,
                owner=held.owner,
                held_for=now - held.acquired_at,
                task_id=held.task_id,
                elapsed=now - asked,
            )
    return lost


def send_signal(signal: Any, resource: str, **kwargs: Any) -> None:
    try:
        signal.send(sender=resource, resource=resource, **kwargs)
    except Exception:
        logger.exception("leases: a receiver of %s failed", signal.name)


def raise_first_lost(lost: Sequence[Lease]) -> None:
    """Leaving a ``hold`` block: say that a lease was lost inside it (the first one)."""
    if lost:
        raise held_of(lost[0]).lost_error(time.monotonic())  # LeaseRevoked if it was revoked
