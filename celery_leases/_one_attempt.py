"""One attempt for a script call: the drivers' redis-py retry, made to honour it.

A core operation marks the calls whose replay is not harmless
(:class:`~celery_leases._protocol.Send` with ``once``); the drivers send those inside
:func:`one_attempt`, and their clients' retry (:class:`OnceRetry`, :class:`AsyncOnceRetry`)
then makes a single attempt. Which errors leave the outcome unknown is :data:`UNKNOWN`. See
``_lostreply`` for what each script does after such a loss.
"""

from __future__ import annotations

import copy
import socket
from contextvars import ContextVar
from typing import Any, Final, TypeVar

from redis.asyncio.retry import Retry as AsyncRetry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ._protocol import Failure, Send, SendReplicated

T = TypeVar("T")

__all__ = (
    "UNKNOWN",
    "AsyncOnceRetry",
    "OnceRetry",
    "failure_of",
    "once_on_cluster",
    "one_attempt",
)

#: errors after which a command may or may not have run (redis-py's TimeoutError is no
#: ConnectionError: a reply that came too late is lost all the same)
UNKNOWN: Final = (RedisConnectionError, RedisTimeoutError)

# --- one attempt ------------------------------------------------------------------------------
_ONE_ATTEMPT: ContextVar[bool] = ContextVar("celery_leases_one_attempt", default=False)


class one_attempt:  # lower case: used as a function, ``with one_attempt():``
    """Within this block (thread or asyncio task), redis-py does not retry a failed command.

    An asyncio task made inside the block inherits it (a task copies the context it is made
    in). A class, not a generator: it is on the hot path of every grant and release.
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _ONE_ATTEMPT.set(True)

    def __exit__(self, *exc: object) -> None:
        _ONE_ATTEMPT.reset(self._token)


class OnceRetry(Retry):
    """redis-py's retry, but a single attempt inside :func:`one_attempt` (the script calls).

    A connection's retry runs :meth:`call_with_retry`; a cluster client counts its own
    attempts with :meth:`get_retries` (see :func:`once_on_cluster`).
    """

    def get_retries(self) -> int:
        return 0 if _ONE_ATTEMPT.get() else super().get_retries()

    def call_with_retry(
        self,
        do: Any,
        fail: Any,
        is_retryable: Any = None,
        with_failure_count: bool = False,
    ) -> Any:
        if not _ONE_ATTEMPT.get():
            return super().call_with_retry(do, fail, is_retryable, with_failure_count)
        try:
            return do()
        except self._supported_errors as error:
            # the failure handler closes the connection (it may still carry the reply)
            if with_failure_count:
                fail(error, 1)
            else:
                fail(error)
            raise


class AsyncOnceRetry(AsyncRetry):
    """:class:`OnceRetry` for the asyncio clients."""

    def get_retries(self) -> int:
        return 0 if _ONE_ATTEMPT.get() else super().get_retries()

    async def call_with_retry(
        self,
        do: Any,
        fail: Any,
        is_retryable: Any = None,
        with_failure_count: bool = False,
    ) -> Any:
        if not _ONE_ATTEMPT.get():
            return await super().call_with_retry(do, fail, is_retryable, with_failure_count)
        try:
            return await do()
        except self._supported_errors as error:
            if with_failure_count:
                await fail(error, 1)
            else:
                await fail(error)
            raise


def once_on_cluster(client: Any) -> None:
    """Make a cluster client's own retry a single attempt inside :func:`one_attempt`.

    A cluster client retries a command itself after a connection error or a timeout (its
    nodes' connections do not), up to ``get_retries()`` times: the same blind replay. Its
    retry is kept (backoff, attempts, errors), only of the class that honours the block.
    """
    retry = getattr(client, "retry", None)
    if retry is None or isinstance(retry, (OnceRetry, AsyncOnceRetry)):
        return
    once = copy.copy(retry)
    once.__class__ = AsyncOnceRetry if isinstance(retry, AsyncRetry) else OnceRetry
    client.set_retry(once)


#: causes of a client error that mean the connection was never made, so nothing was sent
#: (a refused connection: nothing listens on the port; a name that does not resolve)
NEVER_SENT: Final = (ConnectionRefusedError, socket.gaierror)


def failure_of(exc: BaseException, op: object = None) -> Failure:
    """A redis error as the protocol's Failure, thrown into the operation that sent ``op``:
    lost when the outcome is unknown (:data:`UNKNOWN`). Not lost if ``op`` went out with one
    attempt and its connection was never made (:data:`NEVER_SENT`): a refused connection is
    no lost reply, and nothing it could have granted is to be read back (issue 27, item 4).
    A request the client may retry is lost all the same: t0 the first attempt runs in Redis
    and its connection is cut; t1 the retry's connection is refused, the error raised."""
    single = (isinstance(op, Send) and op.once) or isinstance(op, SendReplicated)
    return Failure(exc, lost=isinstance(exc, UNKNOWN) and not (single and never_sent(exc)))


def never_sent(exc: BaseException) -> bool:
    """True if ``exc`` (or what caused it) says the connection was never made."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, NEVER_SENT):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
