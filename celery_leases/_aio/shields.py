"""Shields: asyncio's cancellation kept from losing a request's outcome (the asyncio driver only).

A cancelled caller gets its ``CancelledError`` at once; the request it started runs to its
end in a task of its own (:func:`carry`, :func:`shielded`). :func:`within` is a timeout
that cannot lose a cancellation. The sync driver has no twin: a thread is not cancelled.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Final, TypeVar

__all__ = ("carried_here", "carry", "shielded", "within")

T = TypeVar("T")

#: the task :func:`carry` made for the work running in it (each task has its own copy of
#: the context: a task made from that one inherits the value, but is not the task it names)
_SHIELD: ContextVar[asyncio.Future[Any] | None] = ContextVar("celery_leases_shield", default=None)


async def _carried(awaitable: Awaitable[T], outcome: asyncio.Future[T]) -> T | None:
    """Run ``awaitable``, and hand its outcome to ``outcome`` as it ends.

    Set from here, not from a done callback (as :func:`asyncio.shield` does): the awaiter
    wakes one turn of the loop sooner. An error is the awaiter's; the task itself then ends
    with None (nobody is left to retrieve its error when the awaiter was cancelled).
    """
    _SHIELD.set(asyncio.current_task())
    try:
        result = await awaitable
    except asyncio.CancelledError:  # the loop's shutdown: nobody else cancels this task
        if not outcome.done():
            outcome.cancel()
        raise
    except Exception as exc:
        if not outcome.done():
            outcome.set_exception(exc)
        return None
    if not outcome.done():
        outcome.set_result(result)
    return result


def carry(awaitable: Awaitable[T]) -> tuple[asyncio.Task[T | None], asyncio.Future[T]]:
    """A task that runs ``awaitable``, and the future its awaiter waits on instead of it.

    The shield of :func:`shielded`: a cancelled awaiter cancels the future only, the task
    runs to its end (its result: the outcome, or None after an error). It is marked, so the
    requests a store sends from inside it get no task of their own (see ``_execute``). On
    Python 3.12 and later it starts eagerly: its first step runs before this returns.
    """
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()
    carried = _carried(awaitable, outcome)
    if _EAGER:
        # it runs at once up to its first wait (the request written), not a loop turn later
        task = asyncio.Task(carried, loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]
        return task, outcome
    return loop.create_task(carried), outcome


#: tasks may start eagerly (Python 3.12)
_EAGER: Final = sys.version_info >= (3, 12)


async def shielded(awaitable: Awaitable[T]) -> T:
    """Await a redis-py call in a task of its own, so a cancellation of the caller is never lost.

    redis-py's asyncio commands wrap their socket I/O in :func:`asyncio.wait_for`, which
    before Python 3.12 can swallow a cancellation that arrives as the I/O completes: the
    caller then runs on as if never cancelled (a cancelled waiter would go on waiting). Here
    (as under :func:`asyncio.shield`) the caller gets its ``CancelledError`` at once, and the
    call itself runs to its end (its outcome is then dropped; a grant is handled by
    ``_attempt``). The requests a store sends from inside the task get no task of their own.
    """
    _, outcome = carry(awaitable)
    return await outcome


async def within(
    awaitable: Awaitable[Any], timeout: float, undo: Callable[[], object] | None = None
) -> bool:
    """Await ``awaitable`` for up to ``timeout`` seconds; False (and it is cancelled) if late.

    Not :func:`asyncio.wait_for`: before Python 3.12 it can lose a cancellation that comes as
    the awaited thing completes (the caller then runs on as if never cancelled: a waiter keeps
    waiting, a task never ends). If the caller is cancelled or the time runs out and the
    awaited thing succeeds all the same, ``undo`` is called (e.g. to release a lock).
    """
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=max(timeout, 0.0))
    except asyncio.CancelledError:
        _abandon(future, undo)
        raise
    if done:
        future.result()  # raises its exception, if any
        return True
    _abandon(future, undo)
    return False


def _abandon(future: asyncio.Future[Any], undo: Callable[[], object] | None) -> None:
    future.cancel()  # a no-op if it is done

    def settle(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None and undo is not None:
            undo()

    future.add_done_callback(settle)


def carried_here() -> bool:
    """True inside a task of :func:`carry` (an acquire attempt, a holder's release): the
    caller is shielded already, so a request needs no task of its own there."""
    return _SHIELD.get() is asyncio.current_task()
