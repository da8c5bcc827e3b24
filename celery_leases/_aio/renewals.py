"""RenewalLines: the asyncio renewal, on the loop's renewal client, under a deadline.

The renewal client is never queued behind the requests of the loop's other client, and
every renewal has a deadline (the time left before its first lease would count as lost):
a stalled Redis cannot hide a lost lease. Its twin is ``_sync/renewals.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._engine import LeaseEngine
from .._protocol import Script
from .client import LoopState, round_trip
from .replicated import send_replicated
from .shields import within

__all__ = ("RenewalLines",)


class RenewalLines:
    """A store's renewals on each event loop (the clients are the loop's: see ``client``)."""

    def __init__(self, engine: LeaseEngine) -> None:
        self._engine = engine

    async def send(
        self, state: LoopState, calls: Sequence[Script], timeout: float
    ) -> tuple[list[Any], list[Any]]:
        """The renewal's calls on the renewal client, all replies within ``timeout``.

        renew.lua is idempotent (token-checked; it only extends): the renewal client's retry
        may run it twice after a lost reply, which extends the same leases once more.
        """
        sending: asyncio.Future[tuple[list[Any], list[Any]]]
        if self._engine.wait_replicas:
            replicated = send_replicated(state, self._engine, calls, renewal=True)
            sending = asyncio.ensure_future(replicated)
        else:
            sending = asyncio.ensure_future(_unwaited(state.renew_client, calls))
        if not await within(sending, timeout):
            raise RedisTimeoutError(f"no reply within {timeout:.2f}s")
        return sending.result()


async def _unwaited(client: aredis.Redis, calls: Sequence[Script]) -> tuple[list[Any], list[Any]]:
    """:func:`round_trip` without WAIT, shaped as :func:`send_replicated`'s reply."""
    return await round_trip(client, calls), []
