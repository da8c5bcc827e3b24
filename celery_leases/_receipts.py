"""Once's receipts and the redelivery guard's delivery records, written once. No I/O."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._keys import holder_value
from ._lease import Held
from ._lostreply import resend_if_lost
from ._protocol import (
    Command,
    Failure,
    Script,
    Steps,
)
from ._scripts import CommitReceiptReply

if TYPE_CHECKING:
    from ._engine import LeaseEngine


logger = logging.getLogger(__name__)


def get_receipt(engine: LeaseEngine, name: str) -> Steps[str | None]:
    """The stored receipt (JSON text) of ``once(name)``, or None."""
    (value,) = yield from engine.send(
        "read a receipt", [Command(("GET", engine.keys.receipt(name)))]
    )
    return None if value is None else str(value)


def put_delivery_done(
    engine: LeaseEngine, task_id: str, retries: int, state: str, ttl: float
) -> Steps[None]:
    """Record that a delivery of a task ended in ``state`` (kept ``ttl`` seconds).

    The redelivery guard's completion record: a copy of the same delivery that arrives later
    (its ack was lost) is dropped. Idempotent: a resend writes the same value again.
    """
    key = engine.keys.delivery_done(task_id, retries)
    command = Command(("SET", key, state, "PX", engine.ms(ttl)))
    yield from engine.send("record a delivery's end", [command])


def get_delivery_done(engine: LeaseEngine, task_id: str, retries: int) -> Steps[str | None]:
    """The state in which a delivery of a task ended, or None (no completion record)."""
    key = engine.keys.delivery_done(task_id, retries)
    (value,) = yield from engine.send("read a delivery's end", [Command(("GET", key))])
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def commit_receipt(
    engine: LeaseEngine, name: str, held: Held, receipt: str, ttl: float | None
) -> Steps[bool]:
    """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
    keys = [engine.resource_keys(held.resource).exclusive, engine.keys.receipt(name)]
    args: list[Any] = [
        holder_value(held.token, held.owner),
        receipt,
        0 if ttl is None else engine.ms(ttl),
    ]
    try:
        # idempotent: the same receipt, stored again while the holder still holds
        (reply,), _ = yield from resend_if_lost([Script("commit_receipt", keys, args)])
    except Failure as failure:
        raise engine.backend_error("store a receipt", failure) from failure.cause
    return int(reply) == CommitReceiptReply.STORED


def delete_receipt(engine: LeaseEngine, name: str) -> Steps[bool]:
    """Delete the receipt of ``once(name)``; True if there was one."""
    command = Command(("DEL", engine.keys.receipt(name)))
    (deleted,) = yield from engine.send("delete a receipt", [command])
    return bool(deleted)
