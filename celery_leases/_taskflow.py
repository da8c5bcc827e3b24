"""A leased task's way to its leases: the park gate, the grant with its riding limits, the park."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from . import _parking
from ._lease import Held, Lease, Want
from ._limiter import Taker, take
from ._limits import LimitWant
from .exceptions import LeaseBusy

if TYPE_CHECKING:
    from .app import Leases

__all__ = ("DEFER_ATTEMPTS", "Taker", "take_or_park")

#: on_busy="defer": acquire attempts of one delivery when the resource keeps freeing between
#: the failed acquire and the park (each time a newcomer took it first), before LeaseBusy
DEFER_ATTEMPTS: Final = 5


def take_or_park(
    ext: Leases,
    taker: Taker,
    task: Any,
    wants: list[Want],
    limits: list[LimitWant],
    *,
    ttl: float | None,
    wait: float | None,
    on_lost: Callable[[Held], None] | None,
    deferring: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[Lease] | LeaseBusy:
    """Take ``wants`` (through ``taker``: see ``_limiter.Taker``) and admit ``limits``
    (rendered for this call), all or nothing, for the delivery of ``task`` (its
    ``request``): the leases to run the body with, or the ``LeaseBusy`` (a ``RateLimited``
    for a limit) its ``on_busy`` policy is for.

    ``deferring`` (``on_busy="defer"``, a delivery with an id): the park gate first (a copy of
    a parked task is dropped; a newcomer parks behind tasks parked on its lease), and a busy
    lease or limit parks the task (``_parking.defer``); a park that finds room again (the
    holder released meanwhile) tries once more, up to :data:`DEFER_ATTEMPTS` times.

    Raises:
        Ignore: the delivery ends without running the body (parked, or a copy dropped).
        Reject: a park or gate whose outcome is unknown: the message is requeued.
        LeaseBackendError: Redis failed as the leases were taken.
    """
    task_id = task.request.id
    consumed, behind = _parking.admit(ext, task, wants, limits) if deferring else (False, None)
    for attempt in range(DEFER_ATTEMPTS):
        try:
            if behind is not None:  # others are parked on it: behind them, no acquire
                busy, behind = behind, None
                raise busy
            if limits:
                return take(taker, limits, wants, ttl, wait, task_id, on_lost)
            return taker.acquire(wants, ttl=ttl, wait=wait, task_id=task_id, on_lost=on_lost)
        except LeaseBusy as busy:
            if not deferring or attempt == DEFER_ATTEMPTS - 1:
                return busy
            # returns only when the resource (or limit) has room again: acquire once more; a
            # second refusal parks (a restart grace, a waiter queue: see _parking.defer)
            _parking.defer(ext, task, busy, wants, args, kwargs, consumed, limits, attempt > 0)
    raise AssertionError("unreachable: the last attempt returns")  # pragma: no cover
