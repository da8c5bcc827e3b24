"""Init-once with receipts: run a function in exactly one caller at a time across the fleet.

Example — every analysis step needs the analysis's input downloaded and unpacked, once::

    @app.task(base=LeasedTask, lease="analysis:{analysis_id}:step:{step}")
    def run_step(analysis_id, step):
        receipt = leases.once(
            f"analysis:{analysis_id}:input",
            lambda: download_and_extract(analysis_id),   # returns e.g. {"path": ..., "files": 12}
            ttl=60,        # the initializer's lease, renewed while it runs
            wait=600,      # how long the others wait for it
        )
        process(receipt["path"], step)

The first caller takes an exclusive lease on ``celery_leases:once:<name>``, runs the function,
stores its JSON return value as the **receipt** (only while the lease is still its own), and
releases the lease. Every other caller waits for that release (a pub/sub wake, not polling),
then finds the receipt and returns it without running anything. The initializer gets the
same plain value (the JSON round trip of what it returned).

- The function raises: no receipt, the error reaches its caller, the next waiter tries again.
- The initializer dies (kill -9): its lease runs out after ``ttl`` and the next waiter runs
  the function. Make the function idempotent with respect to partial work (e.g. unpack into a
  temporary directory and rename).
- The value is not JSON-serialisable: ``TypeError`` naming the receipt, and nothing is stored.
- ``receipt_ttl`` (or the ``receipt_ttl`` setting) makes receipts expire; by default they stay
  until ``forget(name)``.
- ``receipt(name)`` returns None when there is no receipt, and also when the initializer
  returned None; ``receipt(name, default=MISSING)`` with a sentinel of your own tells them
  apart (``once`` itself always does: a None receipt is a receipt, and ``fn`` is not run again).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from celery.utils.log import get_logger

from ._lease import Held, Lease, Want, check_name_size, held_of
from ._protocol import adrive, drive
from .exceptions import LeaseBusy, LeaseConfigError, LeaseLost

if TYPE_CHECKING:
    from .app import Leases

__all__ = ("aforget", "aonce", "areceipt", "forget", "once", "receipt")

logger = get_logger(__name__)

T = TypeVar("T")


def _decode(name: str, text: str) -> Any:
    return json.loads(text)["value"]


def _encode(name: str, value: object, owner: str, token: int) -> str:
    try:
        return json.dumps(
            {"value": value, "created_at": time.time(), "owner": owner, "token": token},
            allow_nan=False,
            separators=(",", ":"),
        )
    except (TypeError, ValueError) as exc:
        msg = (
            f"once({name!r}): the initializer's return value cannot be stored as a JSON "
            f"receipt ({exc}); nothing was stored"
        )
        raise TypeError(msg) from exc


def receipt(ext: Leases, name: str, default: Any = None) -> Any:
    """The receipt of ``once(name, ...)``, or ``default`` (None) when there is none.

    A receipt may itself be None (an initializer that returned None): pass a ``default`` of
    your own to tell the two apart.
    """
    _check_name(name)
    text = ext.store.get_receipt(name)
    return default if text is None else _decode(name, text)


def forget(ext: Leases, name: str) -> bool:
    """Delete the receipt of ``once(name, ...)``; True if there was one."""
    _check_name(name)
    return ext.store.delete_receipt(name)


def _checked_call(
    what: str, ext: Leases, name: str, fn: object, receipt_ttl: float | None
) -> float | None:
    """Check the arguments of ``once``/``aonce``; the receipt TTL in force."""
    _check_name(name)
    if not callable(fn):
        msg = f"{what}({name!r}, fn): fn must be callable, not {fn!r}"
        raise LeaseConfigError(msg)
    return ext.settings.receipt_ttl if receipt_ttl is None else receipt_ttl


def _log_busy(name: str, busy: LeaseBusy) -> None:
    msg_wait = f" after waiting {busy.waited:.1f}s" if busy.waited else ""
    logger.info("leases: once(%s) is still being initialised%s", name, msg_wait)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        msg = f"once() needs a non-empty str name, not {name!r}"
        raise LeaseConfigError(msg)
    check_name_size(name, "the once name")


# --- the flow, written once ------------------------------------------------------------------
# ``once`` and ``aonce`` differ only in how each step is carried out (a call, or an await), so
# the flow is one generator of steps and each of them a short loop that carries them out. A
# step that raises is thrown back into the flow, so the lease is released (the ``finally``
# yields a _Release) whatever happens, cancellation of an asyncio caller included.


class _GetReceipt(NamedTuple):
    pass


class _Acquire(NamedTuple):
    wait: float | None


class _Call(NamedTuple):
    pass


class _Commit(NamedTuple):
    held: Held
    encoded: str


class _Release(NamedTuple):
    lease: Lease


_Step = _GetReceipt | _Acquire | _Call | _Commit | _Release


def _flow(name: str, wait: float | None) -> Generator[_Step, Any, Any]:
    """The steps of ``once(name)``: they are sent their results; returns the receipt."""
    text = yield _GetReceipt()
    if text is not None:
        return _decode(name, text)
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            lease: Lease = yield _Acquire(left)
        except LeaseBusy as busy:
            _log_busy(name, busy)
            raise
        try:
            # someone may have finished while we waited for the lease
            text = yield _GetReceipt()
            if text is not None:
                return _decode(name, text)
            logger.info("leases: once(%s) initialising", name)
            value = yield _Call()
            held = held_of(lease)
            encoded = _encode(name, value, held.owner, lease.token)
            lease.check()
            if not (yield _Commit(held, encoded)):
                raise LeaseLost(lease.resource, held_for=time.monotonic() - held.acquired_at)
            logger.info("leases: once(%s) stored its receipt", name)
            return _decode(name, encoded)
        finally:
            yield _Release(lease)


def once(
    ext: Leases,
    name: str,
    fn: Callable[[], object],
    *,
    ttl: float | None = None,
    wait: float | None = None,
    receipt_ttl: float | None = None,
) -> Any:
    """Run ``fn`` once across the fleet and return its receipt (see the module docs).

    Raises:
        LeaseBusy: another caller still initialises after ``wait`` seconds.
        LeaseLost: the lease was lost while ``fn`` ran, so the receipt was not stored (the
            next caller runs ``fn`` again).
        TypeError: ``fn`` returned something that is not JSON-serialisable.
    """
    receipt_ttl = _checked_call("once", ext, name, fn, receipt_ttl)
    store = ext.store
    want = Want(store.keys.once_resource(name))

    def carry_out(step: _Step) -> Any:
        if isinstance(step, _GetReceipt):
            return store.get_receipt(name)
        if isinstance(step, _Acquire):
            return ext.acquire([want], ttl=ttl, wait=step.wait)[0]
        if isinstance(step, _Call):
            return fn()
        if isinstance(step, _Commit):
            return store.commit_receipt(name, step.held, step.encoded, receipt_ttl)
        return ext.release([step.lease])

    # an error of a step is thrown back in: the flow releases its lease
    return drive(_flow(name, wait), carry_out, BaseException)


# --- asyncio ----------------------------------------------------------------------------------
async def areceipt(ext: Leases, name: str, default: Any = None) -> Any:
    """:func:`receipt` for asyncio."""
    _check_name(name)
    text = await ext.astore.get_receipt(name)
    return default if text is None else _decode(name, text)


async def aforget(ext: Leases, name: str) -> bool:
    """:func:`forget` for asyncio."""
    _check_name(name)
    return await ext.astore.delete_receipt(name)


async def aonce(
    ext: Leases,
    name: str,
    fn: Callable[[], object],
    *,
    ttl: float | None = None,
    wait: float | None = None,
    receipt_ttl: float | None = None,
) -> Any:
    """:func:`once` for asyncio: the same lease, receipt and errors (see the module docs).

    ``fn`` may be a coroutine function, awaited on the loop, or a plain function, run in a
    worker thread so that it cannot stall the loop (nor the heartbeat renewing its lease).
    Cancelling the caller cancels a coroutine initializer and releases the lease, so the next
    waiter takes over at once; a thread cannot be cancelled, so a cancelled caller keeps the
    lease (renewed) until its plain function returns, and only then lets the next one run.
    """
    receipt_ttl = _checked_call("aonce", ext, name, fn, receipt_ttl)
    astore = ext.astore
    want = Want(ext.store.keys.once_resource(name))

    async def carry_out(step: _Step) -> Any:
        if isinstance(step, _GetReceipt):
            return await astore.get_receipt(name)
        if isinstance(step, _Acquire):
            return (await ext.aacquire([want], ttl=ttl, wait=step.wait))[0]
        if isinstance(step, _Call):
            return await _call(fn)
        if isinstance(step, _Commit):
            return await astore.commit_receipt(name, step.held, step.encoded, receipt_ttl)
        # shielded: a caller cancelled again on its way out still gives the lease back
        return await asyncio.shield(ext.arelease([step.lease]))

    # an error of a step (a cancellation too) is thrown back in: the flow releases its lease
    return await adrive(_flow(name, wait), carry_out, BaseException)


async def _call(fn: Callable[[], object]) -> object:
    """Call an initializer: a coroutine function on the loop, a plain one in a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn()
    running = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        value = await asyncio.shield(running)
    except asyncio.CancelledError:
        # t0 the caller is cancelled while fn runs in a thread; t1 the lease is released;
        # t2 the next caller starts fn while the first one still runs. So wait for it here.
        while not running.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({running})
        raise
    if inspect.isawaitable(value):  # e.g. a lambda that returns a coroutine
        value = await value
    return value
