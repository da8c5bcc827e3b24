"""What the lease protocol asks of a driver: the I/O requests its operations yield.

The protocol (planning each script call, reading its reply, choosing the next step) is
written once, as generators in the core modules (``_grants``, ``_cleanup``, ``_inspect``,
``_claims``). A generator yields one request at a time and is sent the reply:

- :class:`Send`: one round trip of commands (script calls and plain commands) -> their
  replies, in order;
- :class:`SendReplicated`: script calls, each Redis node's followed by ``WAIT`` on the same
  connection (``min_replicas``) -> ``(replies, WAIT replies)``;
- :class:`SendWithin`: a renewal's script calls, under a deadline;
- :class:`Sleep`: wait a while (a sync driver sleeps, an asyncio one awaits);
- :class:`Listen`: in a wait (``_wait``), be subscribed to release channels and wait for a
  message -> :class:`Heard`.

A request that fails is thrown back into the generator as :class:`Failure`, which says
whether its outcome is unknown (the connection was cut or timed out after it was sent:
``lost``), so a lost reply's recovery and a partial grant's give-back exist once, in the
core. The drivers hold only I/O: clients, EVALSHA and NOSCRIPT, mapping redis-py's
errors to :class:`Failure`, subscriber connections, cancellation shields and WAIT routing.

Nothing here (nor in the core modules) imports redis or asyncio.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from ._scripts import SHA

__all__ = (
    "Command",
    "Failure",
    "Heard",
    "Listen",
    "Op",
    "ReplicaShortfall",
    "Script",
    "Send",
    "SendReplicated",
    "SendWithin",
    "Sleep",
    "Steps",
    "adrive",
    "clock_ms",
    "clock_us",
    "drive",
    "pairs",
    "words_of",
)

T = TypeVar("T")


class Script(NamedTuple):
    """One call of a Lua script of ``lua/``, by its name in ``_scripts.ALL``."""

    name: str
    keys: Sequence[str]
    args: Sequence[Any]


class Command(NamedTuple):
    """One plain Redis command, as its words (``("GET", key)``).

    Its reply is what redis-py gives for the command sent with ``execute_command`` and no
    options: the core reads ``ZRANGE ... WITHSCORES`` as flat or paired, and ``SMEMBERS``
    as any iterable (see :func:`pairs`).
    """

    words: tuple[Any, ...]


Call = Script | Command


class Send(NamedTuple):
    """One round trip of ``calls`` (a pipeline when more than one); the reply: their replies.

    Attributes:
        calls: the script calls and commands, in order.
        once: a single attempt, no blind resend by redis-py (script calls whose replay is
            not harmless; the core recovers from a lost reply itself). False: the client's
            own retry may resend it (reads, idempotent writes).
        transaction: sent as MULTI/EXEC.
    """

    calls: Sequence[Call]
    once: bool = True
    transaction: bool = False


class SendReplicated(NamedTuple):
    """Script calls, each node's followed by ``WAIT`` on the same connection (min_replicas).

    The reply: ``(replies in call order, the WAIT replies: one per node the calls went to)``.
    One attempt, like :class:`Send` with ``once``.
    """

    calls: Sequence[Script]


class SendWithin(NamedTuple):
    """Script calls (a renewal) whose replies must all come within ``timeout`` seconds.

    Sent on connections apart from the pooled ones, one round trip per node, each node's
    followed by ``WAIT`` with min_replicas. The reply: ``(replies in call order, the WAIT
    replies, one per node; none without min_replicas)``. One attempt: a late reply is a
    Failure with ``lost``.
    """

    calls: Sequence[Script]
    timeout: float


class Sleep(NamedTuple):
    """Wait ``seconds`` (polling in a recovery); the reply is None."""

    seconds: float


class Listen(NamedTuple):
    """Be subscribed to ``channels``, then wait up to ``timeout`` seconds for a message.

    Only a wait run by a driver's ``run_wait`` yields it (see ``_wait``). The driver keeps
    one subscription for the whole wait: made at its first Listen (so a wait yields one with
    ``timeout`` 0 before the attempt that must not miss a release), given back at its end.
    A message on ``handed_on`` that hands the wait a lease (see ``_wire.handoff``) ends the
    listen at once. The reply: :class:`Heard`.
    """

    channels: Sequence[str]
    timeout: float
    handed_on: str | None = None


class Heard(NamedTuple):
    """What a :class:`Listen` heard: ``token``, of a lease handed over on its ``handed_on``;
    None: a message came or the time ran out (either way, look again)."""

    token: str | None


Op = Send | SendReplicated | SendWithin | Sleep | Listen
#: a core operation: yields requests, is sent their replies, returns its outcome
Steps = Generator[Op, Any, T]


class Failure(Exception):
    """A request failed; thrown into the operation that yielded it.

    Attributes:
        cause: the client's exception (its message ends up in the LeaseBackendError).
        lost: True if the outcome is unknown: the request may have run in Redis (the
            connection was cut, or the reply did not come in time, after it was sent).
    """

    def __init__(self, cause: BaseException, *, lost: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.lost = lost


class ReplicaShortfall(Exception):
    """Too few replicas confirmed a write in time (the outcome is known: not a lost reply)."""


# --- the two driver loops ---------------------------------------------------------------
S = TypeVar("S")


def drive(
    steps: Generator[S, Any, T],
    execute: Callable[[S], Any],
    caught: type[BaseException] | tuple[type[BaseException], ...],
    thrown: Callable[[BaseException, S], BaseException] | None = None,
) -> T:
    """Carry out ``steps``: each request it yields, ``execute``-d; each reply, sent back.

    An error of the ``caught`` types is thrown back in, as ``thrown(error, request)`` if
    given (a store makes it a :class:`Failure`); an unhandled Failure leaves as its cause (the
    client's error).
    """
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except Failure as unhandled:
            raise unhandled.cause from None
        error = None
        try:
            value = execute(step)
        except caught as exc:
            value, error = None, exc if thrown is None else thrown(exc, step)


async def adrive(
    steps: Generator[S, Any, T],
    execute: Callable[[S], Awaitable[Any]],
    caught: type[BaseException] | tuple[type[BaseException], ...],
    thrown: Callable[[BaseException, S], BaseException] | None = None,
) -> T:
    """:func:`drive`, with requests that are awaited."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except Failure as unhandled:
            raise unhandled.cause from None
        error = None
        try:
            value = await execute(step)
        except caught as exc:
            value, error = None, exc if thrown is None else thrown(exc, step)


def words_of(call: Call) -> tuple[Any, ...]:
    """The words a driver sends for ``call`` (EVALSHA for a script)."""
    if isinstance(call, Command):
        return call.words
    return ("EVALSHA", SHA[call.name], len(call.keys), *call.keys, *call.args)


def pairs(reply: Any) -> list[tuple[str, float]]:
    """``ZRANGE ... WITHSCORES`` read as ``(member, score)`` pairs, flat (RESP2) or paired."""
    items = list(reply or ())
    if items and isinstance(items[0], (list, tuple)):
        return [(str(m), float(s)) for m, s in items]
    return [(str(items[i]), float(items[i + 1])) for i in range(0, len(items), 2)]


def clock_ms(reply: Any) -> int:
    """The Redis clock (``TIME``, or the now script's reply) in milliseconds."""
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


def clock_us(reply: Any) -> int:
    """The Redis clock in microseconds."""
    sec, usec = reply
    return int(sec) * 1_000_000 + int(usec)
