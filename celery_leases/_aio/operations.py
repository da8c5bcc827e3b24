"""Operations: the asyncio store's methods that run one core operation each.

Each is one line over a generator of the core, carried out by
:meth:`AsyncLeaseStore.run <celery_leases._aio.driver.AsyncLeaseStore.run>`. Its twin is
``_sync/operations.py``. The wait (``acquire``) is the driver's own (``driver.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

from .. import _grants, _inspect
from .._engine import LeaseEngine
from .._grants import Busy
from .._identity import Identity
from .._lease import Held, Want
from .._protocol import Steps

__all__ = ("Operations",)

T = TypeVar("T")


class Operations:
    """The store methods callers use, each one core operation (mixed into
    ``AsyncLeaseStore``)."""

    engine: LeaseEngine

    async def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation (the driver's)."""
        raise NotImplementedError

    async def try_acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        task_id: str | None = None,
        ticket: _grants.Ticket | None = None,
    ) -> list[Held] | Busy:
        """One all-or-nothing attempt (see :func:`_grants.try_acquire`)."""
        return await self.run(_grants.try_acquire(self.engine, wants, ident, ttl, task_id, ticket))

    # --- renew ----------------------------------------------------------------------------
    async def renew(self, held: Sequence[Held], owner: str, timeout: float) -> set[int]:
        """Renew ``held`` (all of one owner) within ``timeout`` (see :func:`_grants.renew`).

        Sent on the loop's renewal client, never queued behind the requests of the loop's
        other client, under a deadline: a stalled Redis cannot hide a lost lease.

        Returns:
            the indices (into ``held``) of leases Redis no longer has for us.

        Raises:
            LeaseBackendError: Redis failed, or gave no reply within ``timeout``.
        """
        return await self.run(_grants.renew(self.engine, held, owner, timeout))

    # --- release --------------------------------------------------------------------------
    async def release(self, held: Sequence[Held]) -> list[bool]:
        """Release ``held``; True for each lease that was still ours (as the sync store)."""
        if not held:
            return []
        return await self.run(_grants.release(self.engine, held, time.monotonic()))

    async def holder_task(self, resource: str) -> str | None:
        """:meth:`LeaseStore.holder_task` for asyncio: the busy path only, never raises."""
        return await self.run(_inspect.holder_task(self.engine, resource))

    async def lease_record(self, resource: str) -> dict[str, Any]:
        """:meth:`LeaseStore.lease_record` for asyncio."""
        return await self.run(_inspect.lease_record(self.engine, resource))

    async def history(
        self, *, resource: str | None = None, node: str | None = None, count: int = 50
    ) -> list[dict[str, Any]]:
        """:meth:`LeaseStore.history` for asyncio."""
        engine = self.engine
        return await self.run(_inspect.history(engine, resource=resource, node=node, count=count))

    # --- once receipts --------------------------------------------------------------------
    async def get_receipt(self, name: str) -> str | None:
        """The stored receipt (JSON text) of ``once(name)``, or None."""
        return await self.run(_grants.get_receipt(self.engine, name))

    async def commit_receipt(self, name: str, held: Held, receipt: str, ttl: float | None) -> bool:
        """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
        return await self.run(_grants.commit_receipt(self.engine, name, held, receipt, ttl))

    async def delete_receipt(self, name: str) -> bool:
        """Delete the receipt of ``once(name)``; True if there was one."""
        return await self.run(_grants.delete_receipt(self.engine, name))
