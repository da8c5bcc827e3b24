"""Drive a core operation (a generator of protocol requests) without Redis, in unit tests.

``drive(steps, answer)`` sends each request the operation yields to ``answer``, which returns
its reply or raises :class:`~celery_leases._protocol.Failure` (thrown back in, as a driver
would); it returns the operation's outcome and the requests it made, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from celery_leases import _protocol
from celery_leases._protocol import Failure, Op, Steps

T = TypeVar("T")


def drive(steps: Steps[T], answer: Callable[[Op], Any]) -> tuple[T, list[Op]]:
    """Carry out ``steps`` with ``answer`` for the I/O; ``(outcome, requests made)``.

    The package's own driver loop (:func:`celery_leases._protocol.drive`) runs it, so a
    Failure the operation lets through leaves as its cause, as it does from a store.
    """
    made: list[Op] = []

    def execute(op: Op) -> Any:
        made.append(op)
        return answer(op)

    return _protocol.drive(steps, execute, Failure), made


def replies(*answers: Any) -> Callable[[Op], Any]:
    """An ``answer`` that gives ``answers`` in turn (a Failure instance is raised)."""
    queue: list[Any] = list(answers)

    def answer(op: Op) -> Any:
        assert queue, f"the operation made one request more than expected: {op!r}"
        reply = queue.pop(0)
        if isinstance(reply, Failure):
            raise reply
        return reply

    return answer


def lost() -> Failure:
    """A request whose reply was lost (the connection was cut after it was sent)."""
    return Failure(ConnectionError("cut after sending"), lost=True)


def refused(message: str = "ERR refused") -> Failure:
    """A request Redis answered with an error (its outcome is known)."""
    return Failure(RuntimeError(message), lost=False)


def scripts(ops: Sequence[Op]) -> list[str]:
    """The script names of every call the requests made, in order ("cmd:<WORD>" for a command)."""
    out: list[str] = []
    for op in ops:
        for call in getattr(op, "calls", ()):
            name = getattr(call, "name", None)
            out.append(name if name is not None else f"cmd:{call.words[0]}")
    return out
