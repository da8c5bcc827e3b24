"""LeaseStore: the sync driver of the lease protocol, and the store the package calls.

Its methods run the core operations (``_grants``, ``_cleanup``, ``_inspect``, ``_claims``)
and carry out their requests: a client per process (made anew after a fork), EVALSHA and
NOSCRIPT, redis-py's errors thrown back in as :class:`~celery_leases._protocol.Failure`,
WAIT routing, the renewal lines (``_renewlines``) and the subscribers (``_subscribers``).
The asyncio driver is ``_astore.AsyncLeaseStore``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from celery.utils.log import get_logger
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from . import _claims, _cleanup, _connect, _grants, _inspect, _lifetime, _scripts, _wait
from ._claims import BeatClaim, BeatRun, Claimed, ClaimHolder
from ._cleanup import CleanupReport
from ._engine import LeaseEngine, ResourceKeys
from ._grants import Busy
from ._identity import Identity
from ._inspect import Holder
from ._lanes import Lanes
from ._lease import Held, Want
from ._once import (
    OnceRetry,
    failure_of,
    once_on_cluster,
    one_attempt,
)
from ._protocol import (
    Call,
    Command,
    Op,
    Script,
    Send,
    SendReplicated,
    SendWithin,
    Sleep,
    Steps,
    drive,
    words_of,
)
from ._registry import (
    Entry,
)
from ._renewlines import RenewalLines
from ._scripts import (
    SOURCE,
)
from ._subscribers import Subscribers
from ._wait import Wait
from .config import LeaseSettings, safe_url
from .exceptions import LeaseBackendError, LeaseConfigError

logger = get_logger(__name__)

T = TypeVar("T")

__all__ = ("LeaseStore", "safe_url")


class LeaseStore:
    """Acquire, renew, release, clean up and inspect leases in one Redis, under one prefix.

    Clients are made lazily in each process and made anew after a fork. Every redis error is
    raised as :class:`~celery_leases.exceptions.LeaseBackendError`.
    """

    def __init__(self, settings: LeaseSettings) -> None:
        self.settings = settings
        #: the protocol's memory in this process, shared with the asyncio driver
        self.engine = engine = LeaseEngine(settings)
        engine.store = self
        self.keys = engine.keys
        self.url = settings.url
        self._lock = threading.Lock()
        self._subscribers = Subscribers(lambda: self.client, settings.socket_timeout)
        self._renewals = RenewalLines(self)
        self._lanes = Lanes()
        # the client object connects lazily; made now so a bad URL fails at start-up, and so
        # the scripts are registered before any method can reach for them
        self._target = _connect.parse_target(self.url)
        self._client: redis.Redis | None = self._make_client()
        #: True on a Redis Cluster (grants, renewals and cleanups go per node there)
        self.cluster = engine.cluster = _connect.is_cluster(self._client)
        self._pid = os.getpid()

    # --- clients --------------------------------------------------------------------------
    @property
    def client(self) -> redis.Redis:
        """This process's client (made on first use, and again after a fork)."""
        pid = os.getpid()
        client = self._client
        if client is not None and self._pid == pid:
            return client
        with self._lock:
            if self._client is None or self._pid != pid:
                self._client = self._make_client()
                self._pid = pid
                self.engine.forked()
            return self._client

    def _make_client(self) -> redis.Redis:
        s = self.settings
        try:
            client = _connect.make_client(
                self._target,
                self._connect_check(),
                decode_responses=True,
                socket_timeout=s.socket_timeout,
                socket_connect_timeout=s.socket_connect_timeout,
                # one retry on a connection error, but none for the script calls, which
                # recover on their own (see _lostreply)
                retry=OnceRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                client_name="celery_leases",
            )
        except (ValueError, TypeError, RedisError, RedisClusterException) as exc:
            # a sync cluster client reads the slot map as it is made: an unreachable cluster,
            # or one that refuses the TLS handshake, shows here (RedisClusterException is not
            # a RedisError)
            msg = f"redis_url {safe_url(self.url)!r} is not usable: {exc}"
            raise LeaseConfigError(msg) from None
        if _connect.is_cluster(client):
            once_on_cluster(client)  # it retries on its own, also the script calls
        return client

    def _connect_check(self) -> Callable[[Any], None] | None:
        """The restart check each new connection runs first (see _lifetime)."""
        cluster = self._target.kind == "cluster"
        return _lifetime.connect_hook(self.keys, self.settings, cluster=cluster)

    def close(self) -> None:
        """Close this process's connections (a new client is made on next use)."""
        with self._lock:
            client, self._client = self._client, None
        self._subscribers.close()
        if client is not None and self._pid == os.getpid():
            client.close()
        self._lanes.close()
        self._renewals.close()

    def backend_error(self, what: str, exc: BaseException) -> LeaseBackendError:
        """The LeaseBackendError for ``exc`` while trying to ``what`` (the URL without secrets)."""
        return self.engine.backend_error(what, exc)

    @contextmanager
    def _backend(self, what: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise self.backend_error(what, exc) from exc

    def ping(self) -> bool:
        """True if Redis answers."""
        with self._backend("answer PING"):
            return bool(self.client.ping())

    def redis_time(self) -> float:
        """The Redis server's clock, in Unix seconds: the one clock every worker shares."""
        return self.run(_cleanup.redis_time(self.engine))

    def load_scripts(self) -> dict[str, str]:
        """``SCRIPT LOAD`` every script; returns name -> SHA (proves the wheel ships them)."""
        with self._backend("load scripts"):
            return {name: self.client.script_load(src) for name, src in _scripts.ALL.items()}

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

    # --- the driver -----------------------------------------------------------------------
    def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation: each request it yields, sent; each reply, sent back.

        A redis error is thrown into it as :class:`~celery_leases._protocol.Failure`.
        """
        return drive(steps, self._execute, RedisError, failure_of)

    def run_wait(self, wait: Wait[T]) -> T:
        """Carry out a wait (see ``_wait``): :meth:`run`, its Listens on one subscription.

        Interrupted (an exception from here, not from the wait: a signal, a soft time
        limit), the wait is stopped where it stood and gives back what it must.
        """
        with self._subscribers.listening(self._execute) as listening:
            try:
                return drive(wait.steps, listening.execute, RedisError, failure_of)
            except BaseException as exc:
                if _wait.stopped(wait, exc):
                    self.run(wait.give_back(None))
                raise

    def _execute(self, op: Op) -> Any:
        if type(op) is Send:
            calls = op.calls
            if len(calls) == 1 and not self.cluster and not op.transaction:
                call = calls[0]
                if type(call) is Script:  # a grant, a release: on this thread's lane (_lanes)
                    return [self._lanes.send(self.client, call, op.once)]
                if type(call) is Command and call.words[0] == "GET":
                    # a plain read (the redelivery guard's, once per task): the same reply
                    # as redis-py's (GET has no response callback), without its overhead
                    return [self._lanes.send(self.client, call, op.once)]
            if op.once:
                with one_attempt():
                    return self._send_op(op)
            return self._send_op(op)
        if type(op) is SendReplicated:
            with one_attempt():
                return self._send_replicated(op.calls)
        if type(op) is SendWithin:
            return self._renewals.send(op.calls, op.timeout)
        if type(op) is Sleep:
            time.sleep(op.seconds)
            return None
        raise TypeError(f"not a request of the lease protocol: {op!r}")

    def _send_op(self, op: Send) -> list[Any]:
        """One round trip of ``op``'s calls; NOSCRIPT loads the script and sends again."""
        client: Any = self.client
        calls = op.calls
        if len(calls) == 1 and not op.transaction:
            call = calls[0]
            if type(call) is Command:
                return [client.execute_command(*call.words)]
            assert isinstance(call, Script)
            words = words_of(call)  # on a cluster: routed by the client (off it, see _execute)
            try:
                return [client.execute_command(*words)]
            except NoScriptError:
                client.script_load(SOURCE[call.name])
                return [client.execute_command(*words)]
        return self._round_trip(client, calls, transaction=op.transaction)

    @staticmethod
    def _round_trip(target: Any, calls: Sequence[Call], *, transaction: bool = False) -> list[Any]:
        """One round trip of ``calls`` in a pipeline of ``target``.

        If Redis lost a script (a restart, SCRIPT FLUSH), it is loaded (on every primary of
        a cluster) and the pipeline sent once more. The first error reply is raised.
        """
        for attempt in (1, 2):
            pipe = target.pipeline(transaction=transaction)
            for call in calls:
                pipe.execute_command(*words_of(call))
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies):
                for name in {c.name for c in calls if isinstance(c, Script)}:
                    target.script_load(SOURCE[name])
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def _send_replicated(self, calls: Sequence[Script]) -> tuple[list[Any], list[Any]]:
        """Each node's calls then ``WAIT`` on one connection, in one round trip per node."""
        routes: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            routes.setdefault(self.node_of(call.keys[0]), []).append(i)
        replies: list[Any] = [None] * len(calls)
        acked: list[Any] = []
        wait = Command(self.wait_replicas)
        for node, idx in routes.items():
            target: Any = self.client
            if self.cluster:  # WAIT must go down the same connection as the writes
                target = target.get_redis_connection(target.get_node(node_name=node))
            *got, count = self._round_trip(target, [*(calls[i] for i in idx), wait])
            for i, reply in zip(idx, got, strict=True):
                replies[i] = reply
            acked.append(count)
        return replies, acked

    def try_acquire(
        self, wants: Sequence[Want], ident: Identity, ttl: float, task_id: str | None = None
    ) -> list[Held] | Busy:
        """One all-or-nothing attempt at ``wants`` (see :func:`_grants.try_acquire`)."""
        return self.run(_grants.try_acquire(self.engine, wants, ident, ttl, task_id))

    def acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        wait: float | None = 0.0,
        task_id: str | None = None,
    ) -> list[Held]:
        """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

        See :func:`_wait.acquire`: woken by a release (no polling), first come, first
        served; it holds nothing while it waits, and leaves the queues when it stops.

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        return self.run_wait(_wait.acquire(self.engine, wants, ident, ttl, wait, task_id))

    # --- renew ----------------------------------------------------------------------------
    def renew(self, held: Sequence[Held], owner: str, timeout: float) -> set[int]:
        """Renew ``held`` (all of one owner) within ``timeout`` (see :func:`_grants.renew`).

        Returns:
            the indices (into ``held``) of leases Redis no longer has for us.
        """
        return self.run(_grants.renew(self.engine, held, owner, timeout))

    def node_of(self, key: str) -> str:
        """The name of the cluster node serving ``key`` ("" off a cluster)."""
        if not self.cluster:
            return ""
        node = self.client.get_node_from_key(key)  # type: ignore[attr-defined]
        return str(node.name)

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
        """Claim one due run of beat entry ``entry`` (see :func:`_claims.beat_claim`).

        Returns:
            ``(won, run id, Redis time in ms, winner of that run)``.
        """
        return self.run(
            _claims.beat_claim(
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
    ) -> BeatClaim:
        """Claim one due run of beat entry ``entry``, judged on the Redis clock (see
        :func:`_claims.claim_beat_run`)."""
        return self.run(
            _claims.claim_beat_run(
                self.engine,
                entry,
                due_ms=due_ms,
                bucket=bucket,
                replica=replica,
                keep=keep,
                tolerance=tolerance,
            )
        )

    def beat_runs(self, entries: Sequence[str]) -> list[BeatRun]:
        """The last claimed run of each beat entry that has one (see `_claims.beat_runs`)."""
        return self.run(_claims.beat_runs(self.engine, entries))

    # --- unique claims (see _claims) ----------------------------------------------------------
    def unique_claim(self, key: str, task_id: str, ttl: float) -> Claimed | ClaimHolder:
        """Claim ``key`` for ``task_id``, about to be published, for ``ttl`` seconds.

        Returns:
            :class:`Claimed` (``again`` when it was already queued for this task id), or the
            :class:`ClaimHolder` that has it.
        """
        return self.run(_claims.unique_claim(self.engine, key, task_id, ttl))

    def unique_confirm(self, key: str, task_id: str, token: int, ttl: float) -> bool:
        """Confirm the pending claim of ``key`` for ``task_id`` (published): it lives ``ttl``.

        False, changing nothing, when it is no longer queued for that task and token.
        """
        return self.run(_claims.unique_confirm(self.engine, key, task_id, token, ttl))

    def unique_handover(
        self, key: str, task_id: str, ident: Identity, ttl: float
    ) -> Held | ClaimHolder:
        """One attempt to take over ``key``'s claim for ``task_id`` as a lease of ``ident``.

        It succeeds when the claim is queued for ``task_id`` or when there is none.
        """
        return self.run(_claims.unique_handover(self.engine, key, task_id, ident, ttl))

    def unique_take(
        self, key: str, task_id: str, ident: Identity, ttl: float, wait: float
    ) -> Held | ClaimHolder:
        """Take over ``key``'s claim for ``task_id``, waiting up to ``wait`` seconds where
        waiting can help (see :func:`_wait.unique_take`)."""
        return self.run_wait(_wait.unique_take(self.engine, key, task_id, ident, ttl, wait))

    def wait_until_free(self, resource: str, timeout: float | None) -> bool:
        """Wait until ``resource`` has no holder (True) or ``timeout`` seconds pass (False;
        None: no limit), taking nothing (see :func:`_wait.until_free`)."""
        return self.run_wait(_wait.until_free(self.engine, resource, timeout))

    def unique_requeue(self, held: Held, ttl: float) -> bool:
        """Put a running claim (``held``) back in the queued state for its task, for ``ttl``.

        Returns False, changing nothing, when ``held`` no longer has the claim.
        """
        return self.run(_claims.unique_requeue(self.engine, held, ttl))

    def unique_unclaim(self, key: str, task_id: str, token: int | None = None) -> bool:
        """Release ``key``'s claim if it is still queued for ``task_id`` (and ``token``).

        Returns True if it was released; a claim a worker took over, or one of another task,
        is left alone.
        """
        return self.run(_claims.unique_unclaim(self.engine, key, task_id, token))

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
