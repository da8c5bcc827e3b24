"""Operations: the sync store's methods that run one core operation each.

Each is one line over a generator of the core (``_grants``, ``_cleanup``, ``_inspect``,
``_claims``), carried out by :meth:`LeaseStore.run <celery_leases._sync.driver.LeaseStore.run>`.
Its twin is ``_aio/operations.py``. The waits (``acquire``, ``unique_take``) are the
driver's own (``driver.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from .. import _beat_claims, _claims, _cleanup, _grants, _inspect, _revocation
from .._beat_claims import BeatClaim, BeatRun
from .._claims import Claimed, ClaimHolder, ClaimMode
from .._cleanup import CleanupReport
from .._engine import LeaseEngine, ResourceKeys
from .._grants import Busy
from .._identity import Identity
from .._inspect import Holder
from .._lease import Held, Want
from .._protocol import Steps
from .._registry import Entry

__all__ = ("Operations",)

T = TypeVar("T")


class Operations:
    """The store methods callers use, each one core operation (mixed into ``LeaseStore``)."""

    engine: LeaseEngine

    def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation (the driver's)."""
        raise NotImplementedError

    def redis_time(self) -> float:
        """The Redis server's clock, in Unix seconds: the one clock every worker shares."""
        return self.run(_cleanup.redis_time(self.engine))

    # --- the engine's rules, for the callers that hold a store -------------------------
    @property
    def wait_replicas(self) -> tuple[Any, ...]:
        """The WAIT command sent after each grant and renewal ((): min_replicas is 0)."""
        return self.engine.wait_replicas

    def resource_keys(self, resource: str) -> ResourceKeys:
        """The key names of ``resource`` (see :meth:`LeaseEngine.resource_keys`)."""
        return self.engine.resource_keys(resource)

    def horizon(self, ttl: float) -> float:
        """Seconds after a confirmation that a lease of ``ttl`` counts as held."""
        return self.engine.horizon(ttl)

    def liveness_covers(self, owner: str, ttl: float) -> bool:
        """See :meth:`LeaseEngine.liveness_covers`: the one rule of the home call."""
        return self.engine.liveness_covers(owner, ttl)

    def try_acquire(
        self, wants: Sequence[Want], ident: Identity, ttl: float, task_id: str | None = None
    ) -> list[Held] | Busy:
        """One all-or-nothing attempt at ``wants`` (see :func:`_grants.try_acquire`)."""
        return self.run(_grants.try_acquire(self.engine, wants, ident, ttl, task_id))

    # --- renew ----------------------------------------------------------------------------
    def renew(self, held: Sequence[Held], owner: str, timeout: float) -> set[int]:
        """Renew ``held`` (all of one owner) within ``timeout`` (see :func:`_grants.renew`).

        Returns:
            the indices (into ``held``) of leases Redis no longer has for us.
        """
        return self.run(_grants.renew(self.engine, held, owner, timeout))

    # --- release --------------------------------------------------------------------------
    def release(self, held: Sequence[Held]) -> list[bool]:
        """Release ``held`` (any owners); True for each lease that was still ours.

        Idempotent: releasing a lease again, or one that already ran out, returns False and
        changes nothing but the registry entry.
        """
        if not held:
            return []
        return self.run(_grants.release(self.engine, held, time.monotonic()))

    # --- cleanup: _cleanup ----------------------------------------------------------------
    def cleanup_owner(
        self,
        owner: str,
        *,
        dead: bool = False,
        granted_before_us: int | None = None,
        clock_offsets_us: Sequence[int] | None = None,
        by: str = "cleanup",
    ) -> CleanupReport:
        """Release every lease ``owner`` still holds (see :func:`_cleanup.cleanup_owner`)."""
        return self.run(
            _cleanup.cleanup_owner(
                self.engine,
                owner,
                dead=dead,
                granted_before_us=granted_before_us,
                clock_offsets_us=clock_offsets_us,
                by=by,
            )
        )

    def cleanup_node(self, node: str, *, keep_incarnation: str | None = None) -> CleanupReport:
        """Release every lease of earlier incarnations of ``node`` (a restarted pod)."""
        return self.run(_cleanup.cleanup_node(self.engine, node, keep_incarnation=keep_incarnation))

    def expired_owners(self, limit: int = 1000) -> list[str]:
        """Owners whose liveness ran out (by the Redis clock), oldest first."""
        return self.run(_cleanup.expired_owners(self.engine, limit))

    def reconcile(self, limit: int = 1000) -> CleanupReport:
        """Release the leases of owners whose liveness ran out (see :func:`_cleanup.reconcile`)."""
        return self.run(_cleanup.reconcile(self.engine, limit))

    def clocks_us(self) -> tuple[int, list[int] | None]:
        """The Redis clock in microseconds and the slot groups' clock offsets (see
        :func:`_cleanup.clocks_us`)."""
        return self.run(_cleanup.clocks_us(self.engine))

    def node_owners(self, node: str) -> list[str]:
        """The owner ids registered under ``node`` (every incarnation and process)."""
        return self.run(_cleanup.node_owners(self.engine, node))

    def cleanup_owner_isolated(
        self,
        owner: str,
        *,
        dead: bool,
        granted_before_us: int | None = None,
        clock_offsets_us: Sequence[int] | None = None,
        by: str = "cleanup",
    ) -> CleanupReport:
        """:meth:`cleanup_owner`, with a failure reported in the result instead of raised."""
        return self.run(
            _cleanup.cleanup_owner_isolated(
                self.engine,
                owner,
                dead=dead,
                granted_before_us=granted_before_us,
                clock_offsets_us=clock_offsets_us,
                by=by,
            )
        )

    # --- operations (cli): _inspect -------------------------------------------------------
    def read_registries(self, owners: Sequence[str]) -> dict[str, list[Entry]]:
        """The registry entries of each of ``owners`` (see :func:`_inspect.read_registries`)."""
        return self.run(_inspect.read_registries(self.engine, owners))

    def check_entries(self, items: Sequence[tuple[str, Entry]]) -> list[tuple[float, int] | None]:
        """For each ``(owner, entry)``: the seconds left on that lease and its token, or None
        if it is gone (see :func:`_inspect.check_entries`)."""
        return self.run(_inspect.check_entries(self.engine, items))

    def read_liveness(self, owners: Sequence[str]) -> dict[str, float | None]:
        """Seconds left on each owner's liveness (negative: it ran out; None: not registered)."""
        return self.run(_inspect.read_liveness(self.engine, owners))

    def force_release(
        self, resource: str, holder: Holder, *, event: str = "forced", by: str = "operator"
    ) -> bool:
        """Release ``holder``'s lease on ``resource``, whoever holds it; True if it was held.

        See :func:`_inspect.force_release`: a lease granted to someone else is never touched.
        """
        return self.run(_inspect.force_release(self.engine, resource, holder, event=event, by=by))

    def revoke(self, resource: str, reason: str, deadline: float) -> _revocation.Revoked:
        """Ask the holders of ``resource`` to let go within ``deadline`` seconds (see
        :func:`_revocation.revoke`)."""
        return self.run(_revocation.revoke(self.engine, resource, reason, deadline))

    def lease_record(self, resource: str) -> dict[str, Any]:
        """What is known of ``resource`` now (see :func:`_inspect.lease_record`)."""
        return self.run(_inspect.lease_record(self.engine, resource))

    def history(
        self, *, resource: str | None = None, node: str | None = None, count: int = 50
    ) -> list[dict[str, Any]]:
        """The last events, newest first (see :func:`_inspect.history`)."""
        return self.run(_inspect.history(self.engine, resource=resource, node=node, count=count))

    def mark_node_alive(self, node: str, incarnation: str) -> None:
        """Mark ``node`` alive for the ttl (see :func:`_inspect.mark_node_alive`)."""
        self.run(_inspect.mark_node_alive(self.engine, node, incarnation))

    def node_alive(self, node: str) -> float | None:
        """Seconds left on ``node``'s mark of life; None: none (see :func:`_inspect.node_alive`)."""
        return self.run(_inspect.node_alive(self.engine, node))

    def node_marks(self, nodes: Sequence[str]) -> dict[str, str | None]:
        """The incarnation each node marked alive; None: none (see :func:`_inspect.node_marks`)."""
        return self.run(_inspect.node_marks(self.engine, nodes))

    def recent_events(self, seconds: float) -> tuple[list[dict[str, Any]], float]:
        """The fleet's events of the last ``seconds`` (see :func:`_inspect.recent_events`)."""
        return self.run(_inspect.recent_events(self.engine, seconds))

    def waiter_counts(self, resources: Sequence[str]) -> list[int]:
        """The live waiters of each of ``resources`` (see :func:`_inspect.waiter_counts`)."""
        return self.run(_inspect.waiter_counts(self.engine, resources))

    def audit(self, record: Mapping[str, object]) -> None:
        """Append ``record`` (JSON-serialisable) to the audit list; the newest are kept."""
        self.run(_inspect.audit(self.engine, record))

    def audit_log(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` audit records, newest first (an unreadable one as ``{"raw": text}``)."""
        return self.run(_inspect.audit_log(self.engine, n))

    # --- inspect --------------------------------------------------------------------------
    def holders(self, resource: str) -> list[Holder]:
        """Who holds ``resource`` now (exclusive holder or live shared holders)."""
        return self.run(_inspect.holders(self.engine, resource))

    def owners(self) -> list[tuple[str, float]]:
        """Every registered owner and the seconds left on its liveness (negative: dead)."""
        return self.run(_inspect.owners(self.engine))

    def owned(self, owner: str) -> list[tuple[str, int, str]]:
        """``(mode, token, resource)`` of what ``owner``'s registries list."""
        return self.run(_inspect.owned(self.engine, owner))

    def entries(self, owner: str) -> list[Entry]:
        """The registry entries of ``owner`` (every slot group), by resource name."""
        return self.run(_inspect.entries(self.engine, owner))

    def nodes(self) -> list[str]:
        """Every node that has registered owners."""
        return self.run(_inspect.nodes(self.engine))

    # --- once receipts -------------------------------------------------------------------
    def get_receipt(self, name: str) -> str | None:
        """The stored receipt (JSON text) of ``once(name)``, or None."""
        return self.run(_grants.get_receipt(self.engine, name))

    def put_delivery_done(self, task_id: str, retries: int, state: str, ttl: float) -> None:
        """Write the redelivery guard's completion record of a delivery."""
        return self.run(_grants.put_delivery_done(self.engine, task_id, retries, state, ttl))

    def get_delivery_done(self, task_id: str, retries: int) -> str | None:
        """The state in which a delivery ended (its completion record), or None."""
        return self.run(_grants.get_delivery_done(self.engine, task_id, retries))

    def commit_receipt(self, name: str, held: Held, receipt: str, ttl: float | None) -> bool:
        """Store ``receipt`` if ``held`` (the once-lease) is still ours; False if it is not."""
        return self.run(_grants.commit_receipt(self.engine, name, held, receipt, ttl))

    def delete_receipt(self, name: str) -> bool:
        """Delete the receipt of ``once(name)``; True if there was one."""
        return self.run(_grants.delete_receipt(self.engine, name))

    # --- beat -------------------------------------------------------------------------------
    def beat_claim(
        self, entry: str, *, due_ms: int | None, bucket: float | None, replica: str, keep: float
    ) -> tuple[bool, int, int, str]:
        """Claim one due run of beat entry ``entry`` (see :func:`_beat_claims.beat_claim`).

        Returns:
            ``(won, run id, Redis time in ms, winner of that run)``.
        """
        return self.run(
            _beat_claims.beat_claim(
                self.engine, entry, due_ms=due_ms, bucket=bucket, replica=replica, keep=keep
            )
        )

    def claim_beat_run(
        self,
        entry: str,
        *,
        due_ms: int | None,
        bucket: float | None,
        replica: str,
        keep: float,
        tolerance: float = 0.0,
        catch_up: float | Literal[""] | None = "",
        next_due_ms: int | None = None,
        latest: bool = False,
    ) -> BeatClaim:
        """Claim one due run of beat entry ``entry``, judged on the Redis clock (see
        :func:`_beat_claims.claim_beat_run`)."""
        return self.run(
            _beat_claims.claim_beat_run(
                self.engine,
                entry,
                due_ms=due_ms,
                bucket=bucket,
                replica=replica,
                keep=keep,
                tolerance=tolerance,
                catch_up=catch_up,
                next_due_ms=next_due_ms,
                latest=latest,
            )
        )

    def beat_runs(self, entries: Sequence[str]) -> list[BeatRun]:
        """The last claimed run of each beat entry that has one (see `_beat_claims.beat_runs`)."""
        return self.run(_beat_claims.beat_runs(self.engine, entries))

    # --- unique claims (see _claims) ----------------------------------------------------------
    def unique_claim(
        self, key: str, task_id: str, ttl: float, mode: ClaimMode | None = None
    ) -> Claimed | ClaimHolder:
        """Claim ``key`` for ``task_id``, about to be published, for ``ttl`` seconds
        (``mode``: a throttle window, replace; see :class:`ClaimMode`).

        Returns:
            :class:`Claimed` (``again`` when it was already queued for this task id), or the
            :class:`ClaimHolder` that has it.
        """
        return self.run(_claims.unique_claim(self.engine, key, task_id, ttl, mode))

    def unique_confirm(
        self, key: str, task_id: str, token: int, ttl: float, mode: ClaimMode | None = None
    ) -> bool:
        """Confirm the pending claim of ``key`` for ``task_id`` (published): it lives ``ttl``
        (and a throttle window of ``mode`` its full length).

        False, changing nothing, when it is no longer queued for that task and token.
        """
        return self.run(_claims.unique_confirm(self.engine, key, task_id, token, ttl, mode))

    def unique_handover(
        self, key: str, task_id: str, ident: Identity, ttl: float
    ) -> Held | ClaimHolder:
        """One attempt to take over ``key``'s claim for ``task_id`` as a lease of ``ident``.

        It succeeds when the claim is queued for ``task_id`` or when there is none.
        """
        return self.run(_claims.unique_handover(self.engine, key, task_id, ident, ttl))

    def unique_requeue(self, held: Held, ttl: float) -> bool:
        """Put a running claim (``held``) back in the queued state for its task, for ``ttl``.

        Returns False, changing nothing, when ``held`` no longer has the claim.
        """
        return self.run(_claims.unique_requeue(self.engine, held, ttl))

    def unique_unclaim(
        self, key: str, task_id: str, token: int | None = None, replaced: str | None = None
    ) -> bool:
        """Release ``key``'s claim if it is still queued for ``task_id`` (and ``token``).

        Returns True if it was released; a claim a worker took over, or one of another task,
        is left alone. ``replaced``: the task id its claim replaced, which may run again.
        """
        return self.run(_claims.unique_unclaim(self.engine, key, task_id, token, replaced))

    def unique_holder(self, key: str) -> ClaimHolder | None:
        """Who holds ``key``'s claim now, or None when it is free."""
        return self.run(_claims.unique_holder(self.engine, key))

    def queued_claims(self) -> list[ClaimHolder]:
        """Every unique claim still queued (its task not started yet), by key."""
        return self.run(_claims.queued_claims(self.engine))

    def holder_task(self, resource: str) -> str | None:
        """The task id of the exclusive holder of ``resource``, for a busy error's message
        (see :func:`_inspect.holder_task`): None rather than an error."""
        return self.run(_inspect.holder_task(self.engine, resource))
