"""LeaseStore: every Redis call celery_leases makes, and nothing else talks to Redis."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, TypeVar

import redis
from celery.utils.log import get_logger
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import _claims, _connect, _grants, _lifetime, _scripts
from ._claims import TOKEN_MEMORY_MS, Claimed, ClaimHolder
from ._engine import LeaseEngine, ResourceKeys
from ._identity import Identity
from ._keys import (
    escape,
    escaped_node_of_owner,
    holder_parts,
    node_of_owner,
    split_owner,
    unescape,
)
from ._lease import Held, Want
from ._lostreply import (
    BOOK,
    grant_recovery,
    parse_holder,
)
from ._once import (
    UNKNOWN,
    OnceRetry,
    once_on_cluster,
    one_attempt,
)
from ._protocol import (
    Call,
    Command,
    Failure,
    Op,
    ReplicaShortfall,
    Script,
    Send,
    SendReplicated,
    Sleep,
    Steps,
    words_of,
)
from ._registry import (
    Entry,
    entry_text,
    parse_entry,
    split_holder,
)
from ._scripts import (
    SOURCE,
    AcquireReply,
)
from .config import LeaseSettings, safe_url
from .exceptions import LeaseBackendError, LeaseBusy, LeaseConfigError

logger = get_logger(__name__)

T = TypeVar("T")

__all__ = ("CleanupReport", "LeaseStore", "safe_url")

#: extra sleep after a holder's expiry before a waiter tries again
EXPIRY_SLACK: Final = 0.002


#: the Redis clock, read on the node serving KEYS[1] (see LeaseStore._with_now)
NOW_SCRIPT: Final = "return redis.call('TIME')"
#: idle subscriber connections a store keeps per process for waiters
_IDLE_SUBSCRIBERS: Final = 4
#: commands per pipeline of the operations calls (a fleet may have thousands of owners)
_OPS_BATCH: Final = 1000
#: leases released per script call by a cleanup (one call blocks Redis for about 8 us each)
_RELEASE_BATCH: Final = 500
#: records the audit list keeps (the newest)
AUDIT_KEEP: Final = 1000
#: seconds between looks at the grant calls still in flight, in a lost reply's recovery
QUIET_POLL: Final = 0.005


@dataclass
class Busy:
    """A failed attempt: which resource blocked it and for how long at most."""

    resource: str
    wait: float  # seconds until the blocking holder runs out unless renewed


class AcquireCall(NamedTuple):
    """One acquire.lua call, and what its reply needs to be understood."""

    keys: list[str]
    args: list[Any]
    group: int
    wants: Sequence[Want]
    owner: str
    ttl: float
    home: bool
    task_id: str | None
    now: float  # monotonic time the call was made
    registry_s: float  # registry expiry the call sets (0: none)


class RenewPlan(NamedTuple):
    """The renew.lua calls of one renewal: ``(indices into held, keys, args)`` per group."""

    calls: list[tuple[list[int], list[str], list[Any]]]
    sent: float  # monotonic time the renewal was planned (no later than it reaches Redis)
    registry: dict[int, float]  # slot group -> registry expiry the call sets, in seconds


@dataclass
class CleanupReport:
    """What a cleanup pass did.

    Attributes:
        owners: owner ids looked at.
        released: ``(owner, resource)`` of leases that were still held and are now free.
        expired: registry entries whose lease had already run out (removed).
        kept: registry entries that could not be understood; kept, never dropped silently.
        errors: ``(owner, message)`` of owners whose cleanup failed; the others went on.
        freed: ``(owner, registry entry)`` of each lease in ``released``, in the same order:
            the entry tells the holding task's id.
    """

    owners: list[str] = field(default_factory=list)
    released: list[tuple[str, str]] = field(default_factory=list)
    expired: int = 0
    kept: list[tuple[str, str]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    freed: list[tuple[str, Entry]] = field(default_factory=list)

    def merge(self, other: CleanupReport) -> None:
        self.owners += other.owners
        self.released += other.released
        self.freed += other.freed
        self.expired += other.expired
        self.kept += other.kept
        self.errors += other.errors


@dataclass(frozen=True)
class Holder:
    """One holder of a resource, as Redis records it."""

    resource: str
    mode: str
    token: int
    owner: str
    expires_in: float

    @property
    def node(self) -> str:
        return node_of_owner(self.owner)


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
        self._pubsubs: list[redis.client.PubSub] = []  # idle subscribers of this process
        self._pubsub_pid = os.getpid()
        self._renew_lock = threading.Lock()
        # see _renewal_connection: node name ("" off a cluster) -> connection, in _renew_pid
        self._renew_conns: dict[str, Any] = {}
        self._renew_pid = -1
        # the client object connects lazily; made now so a bad URL fails at start-up, and so
        # the scripts are registered before any method can reach for them
        self._target = _connect.parse_target(self.url)
        self._client: redis.Redis | None = self._make_client()
        #: True on a Redis Cluster (grants, renewals and cleanups go per node there)
        self.cluster = engine.cluster = _connect.is_cluster(self._client)
        self._pid = os.getpid()
        self._register_scripts(self._client)

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
                self._register_scripts(self._client)
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

    def _register_scripts(self, client: redis.Redis) -> None:
        # register_script only hashes locally; each store keeps its own Script objects
        self._acquire = client.register_script(_scripts.ACQUIRE)
        self._renew = client.register_script(_scripts.RENEW)
        self._release = client.register_script(_scripts.RELEASE)
        self._expired_owners = client.register_script(_scripts.EXPIRED_OWNERS)
        self._forget_owner = client.register_script(_scripts.FORGET_OWNER)
        self._commit_receipt = client.register_script(_scripts.COMMIT_RECEIPT)
        self._beat_claim = client.register_script(_scripts.BEAT_CLAIM)
        self._now_sha = client.register_script(NOW_SCRIPT).sha
        self._unique_claim = client.register_script(_scripts.UNIQUE_CLAIM)
        self._unique_handover = client.register_script(_scripts.UNIQUE_HANDOVER)
        self._unique_requeue = client.register_script(_scripts.UNIQUE_REQUEUE)
        self._unique_unclaim = client.register_script(_scripts.UNIQUE_UNCLAIM)

    def close(self) -> None:
        """Close this process's connections (a new client is made on next use)."""
        with self._lock:
            client, self._client = self._client, None
            conns, self._renew_conns = self._renew_conns, {}
            pubsubs, self._pubsubs = self._pubsubs, []
        if self._pubsub_pid == os.getpid():
            for pubsub in pubsubs:
                pubsub.close()
        if client is not None and self._pid == os.getpid():
            client.close()
        if self._renew_pid == os.getpid():
            for conn in conns.values():
                conn.disconnect()

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
        with self._backend("read the clock"):
            sec, usec = self.client.time()
        return int(sec) + int(usec) / 1_000_000

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

    def registry_key(self, owner: str, group: int) -> str:
        """The registry key of ``owner`` in slot group ``group`` (cached)."""
        return self.engine.registry_key(owner, group)

    def horizon(self, ttl: float) -> float:
        """Seconds after a confirmation that a lease of ``ttl`` counts as held."""
        return self.engine.horizon(ttl)

    def liveness_covers(self, owner: str, ttl: float) -> bool:
        """See :meth:`LeaseEngine.liveness_covers`: the one rule of the home call."""
        return self.engine.liveness_covers(owner, ttl)

    def _ms(self, seconds: float) -> int:
        return self.engine.ms(seconds)

    # --- the driver -----------------------------------------------------------------------
    def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation: each request it yields, sent; each reply, sent back.

        A redis error is thrown into it as :class:`~celery_leases._protocol.Failure`.
        """
        value: Any = None
        failure: Failure | None = None
        while True:
            try:
                op = steps.send(value) if failure is None else steps.throw(failure)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            failure = None
            try:
                value = self._execute(op)
            except RedisError as exc:
                failure = Failure(exc, lost=isinstance(exc, UNKNOWN))

    def _execute(self, op: Op) -> Any:
        kind = type(op)
        if kind is Send:
            assert isinstance(op, Send)
            if op.once:
                with one_attempt():
                    return self._send_op(op)
            return self._send_op(op)
        if kind is SendReplicated:
            assert isinstance(op, SendReplicated)
            with one_attempt():
                return self._send_replicated(op.calls)
        if kind is Sleep:
            assert isinstance(op, Sleep)
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
            words = words_of(call)
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
            routes.setdefault(self._node_of(call.keys[0]), []).append(i)
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
        """One all-or-nothing attempt at ``wants``; the grants come back in the order given.

        Resources are taken group by group in ascending group order (one script call per
        group; one call in all with a single slot group). If a later group is busy, the groups
        already granted are released again, so the caller never holds part of the set.
        """
        by_group, fresh = self.acquire_plan(wants, ident.owner, ttl)
        single = len(by_group) == 1 and len(next(iter(by_group.values()))) == 1
        if 0 not in by_group and not fresh:
            if single and not self.wait_replicas:
                # the home call and the grant in one round trip (two nodes on a cluster)
                return self._acquire_with_home(next(iter(by_group)), wants, ident, ttl, task_id)
            outcome = self._acquire_group(0, [], ident, ttl, True, task_id)
            if isinstance(outcome, Busy):
                return outcome
            fresh = True
        if single:
            return self._acquire_group(next(iter(by_group)), wants, ident, ttl, not fresh, task_id)
        out: list[Held | None] = [None] * len(wants)
        taken: list[Held] = []
        for group in sorted(by_group):
            idx = sorted(by_group[group], key=lambda i: wants[i].resource)
            try:
                outcome = self._acquire_group(
                    group, [wants[i] for i in idx], ident, ttl, not fresh and group == 0, task_id
                )
            except LeaseBackendError:
                self._release_quietly(taken)  # the groups already granted
                raise
            if isinstance(outcome, Busy):
                if taken:
                    self.release(taken)
                return outcome
            for i, held in zip(idx, outcome, strict=True):
                out[i] = held
                taken.append(held)
        return [h for h in out if h is not None]

    def _release_quietly(self, held: Sequence[Held]) -> None:
        """Release ``held`` where a failure has nobody to tell: it runs out by its TTL (and
        the owner registry lets a cleanup free it sooner)."""
        try:
            self.release(held)
        except LeaseBackendError as exc:
            logger.error("leases: could not release %d lease(s): %s", len(held), exc)

    def _acquire_with_home(
        self, group: int, wants: Sequence[Want], ident: Identity, ttl: float, task_id: str | None
    ) -> list[Held] | Busy:
        """The owner's home call (group 0) and the grant in ``group``, sent together.

        If the home call is refused (restart grace) while the grant went through, the grant is
        given back, as :meth:`try_acquire` would never have asked for it.
        """
        home = self.acquire_call(0, [], ident, ttl, True, task_id)
        call = self.acquire_call(group, wants, ident, ttl, False, task_id)

        def queue(pipe: Any) -> None:
            for c in (home, call):
                pipe.execute_command("EVALSHA", self._acquire.sha, len(c.keys), *c.keys, *c.args)

        book = self.book_keys(wants)
        BOOK.begin(call.owner, book)
        lost = False
        try:
            try:
                with one_attempt():
                    replies = self._pipeline(self.client, queue, _scripts.ACQUIRE)
            except UNKNOWN as exc:
                # read-back: the grant is adopted if it was made; the home call is idempotent
                BOOK.lost(call.owner, book)
                lost = True
                tokens = self._recover_grant_logged(call, exc)
                adopted = (
                    None
                    if tokens is None
                    else self.acquire_outcome(call, [AcquireReply.GRANTED, *tokens])
                )
            except RedisError as exc:
                raise self.backend_error("acquire", exc) from exc
            else:
                registered = self.acquire_outcome(home, replies[0])
                outcome = self.acquire_outcome(call, replies[1])
                if isinstance(registered, Busy):
                    if not isinstance(outcome, Busy):
                        self.release(outcome)
                    return registered
                return outcome
        finally:
            BOOK.end(call.owner, book, recovered=lost)
        # the reply was lost: the home call again, then (unless adopted) the grant again
        registered = self._acquire_group(0, [], ident, ttl, True, task_id)
        if isinstance(registered, Busy):
            if adopted is not None and not isinstance(adopted, Busy):
                self.release(adopted)
            return registered
        if adopted is not None:
            return adopted
        return self._acquire_group(group, wants, ident, ttl, False, task_id)

    def acquire_plan(
        self, wants: Sequence[Want], owner: str, ttl: float
    ) -> tuple[dict[int, list[int]], bool]:
        """``(slot group -> indices into wants, True if the owner's home call can be skipped)``.

        Shared with the asyncio store, which makes the same calls in the same order.
        """
        if len(wants) == 1:
            by_group = {self.resource_keys(wants[0].resource).group: [0]}
        else:
            if len({w.resource for w in wants}) != len(wants):
                names = [w.resource for w in wants]
                dupes = sorted({n for n in names if names.count(n) > 1})
                msg = f"the same resource is asked for twice in one request: {dupes}"
                raise LeaseConfigError(msg)
            by_group = {}
            for i, w in enumerate(wants):
                by_group.setdefault(self.resource_keys(w.resource).group, []).append(i)
        return by_group, self.liveness_covers(owner, ttl)

    def _acquire_group(
        self,
        group: int,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        home: bool,
        task_id: str | None = None,
    ) -> list[Held] | Busy:
        # A grant whose reply is lost (the connection cut or timed out after the request went
        # out) is read back: t0 acquire.lua grants R to this owner; t1 the reply is lost; t2 a
        # plain retry finds R held by this owner and reports it busy, and nobody renews or
        # releases the grant of t0 until its TTL. So the call goes out once
        # (one_attempt), and after a lost reply the grant of t0 is adopted if it is surely
        # this call's, else given back and the call sent once more.
        book = self.book_keys(wants)
        for attempt in (1, 2):
            call = self.acquire_call(group, wants, ident, ttl, home, task_id)
            BOOK.begin(call.owner, book)
            lost = False
            try:
                try:
                    with one_attempt():
                        if self.wait_replicas:
                            reply = self._acquire_replicated(call)
                        else:
                            reply = self._acquire(call.keys, call.args, client=self.client)
                    return self.acquire_outcome(call, reply)
                except ReplicaShortfall as exc:  # the grant was given back already
                    raise self.backend_error("acquire", exc) from exc
                except UNKNOWN as exc:
                    if wants:
                        BOOK.lost(call.owner, book)
                        lost = True
                        tokens = self._recover_grant_logged(call, exc)
                        if tokens is not None:
                            return self.acquire_outcome(call, [AcquireReply.GRANTED, *tokens])
                    # the home call alone is idempotent: it is simply sent again
                    if attempt == 2:
                        raise self.backend_error("acquire", exc) from exc
                except RedisError as exc:
                    raise self.backend_error("acquire", exc) from exc
            finally:
                BOOK.end(call.owner, book, recovered=lost)
        raise AssertionError("unreachable")

    def book_keys(self, wants: Sequence[Want]) -> list[str]:
        """The keys :data:`~celery_leases._lostreply.BOOK` knows ``wants``' grants by."""
        return [self.resource_keys(w.resource).exclusive for w in wants]

    def _recover_grant_logged(self, call: AcquireCall, exc: BaseException) -> list[int] | None:
        """:meth:`recover_grant` for ``call``; a recovery that fails is logged, and raised."""
        wants = [(w.resource, w.mode) for w in call.wants]
        try:
            return self.recover_grant(
                call.owner, call.group, wants, call.task_id, self.adopt_until(call)
            )
        except (RedisError, LeaseBackendError) as failed:
            self.log_unrecovered([r for r, _ in wants], exc, failed)
            if isinstance(failed, LeaseBackendError):
                raise
            raise self.backend_error("acquire", failed) from failed

    def adopt_until(self, call: AcquireCall) -> float:
        """Until when (monotonic) a lost grant of ``call`` may be adopted rather than given back.

        An adopted lease counts as confirmed when the call was sent, the latest time it can
        have been granted: adopted with little of its horizon left, it would count as lost
        before the heartbeat could renew it. With min_replicas, never (0): the replicas'
        answer was lost too.
        """
        if self.wait_replicas:
            return 0.0
        return call.now + self.horizon(call.ttl) / 2

    def log_unrecovered(
        self, resources: Sequence[str], lost: BaseException, failed: BaseException
    ) -> None:
        """Tell the operator about a grant that may be left behind by a lost reply."""
        logger.error(
            "leases: the reply to a grant of %s was lost (%s) and it could not be read back "
            "(%s): a grant it made is held until its TTL runs out (the owner's registry "
            "records it, so a cleanup frees it sooner)",
            ", ".join(repr(r) for r in resources),
            lost,
            failed,
        )

    def recover_grant(
        self,
        owner: str,
        group: int,
        wants: Sequence[tuple[str, str]],
        task_id: str | None,
        adopt_until: float,
    ) -> list[int] | None:
        """After a grant call's reply was lost: its tokens if it granted, else None.

        Waits until no other grant call of this process on these resources is in flight
        (each ends within the socket timeout), reads back this owner's grants of them, and
        decides with :func:`~celery_leases._lostreply.grant_recovery`: the lost call's grant
        is adopted (returned), or every orphan grant of this owner (no live lease of this
        process has its token) is released. A grant is adopted only until ``adopt_until``
        (monotonic; see :meth:`adopt_until`). Raises a redis error if Redis cannot be read.
        """
        book = [self.resource_keys(r).exclusive for r, _ in wants]
        registry = self.registry_key(owner, group)

        def build(pipe: Any) -> None:
            for resource, _ in wants:
                rk = self.resource_keys(resource)
                pipe.get(rk.exclusive)
                pipe.zrange(rk.shared, 0, -1, withscores=True)
            pipe.smembers(registry)

        end = time.monotonic() + 2 * self.settings.socket_timeout
        while True:
            seq = BOOK.quiet(owner, book)
            if seq is not None:
                # with the Redis clock: a shared member that ran out is no grant to adopt
                replies, now_ms = self._with_now(build, registry)
                if BOOK.unchanged(owner, book, seq):
                    break
            if time.monotonic() >= end:
                raise RedisTimeoutError("other grant calls of this process are still in flight")
            time.sleep(QUIET_POLL)
        adopted, orphans = settle_lost_grant(
            owner, wants, book, replies, now_ms, adopt_until, task_id
        )
        if orphans:
            self._release_entries(owner, group, orphans)
        return adopted

    def acquire_call(
        self,
        group: int,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        home: bool,
        task_id: str | None = None,
    ) -> AcquireCall:
        """The keys and arguments of one acquire.lua call (no Redis call)."""
        owner = ident.owner
        now = time.monotonic()
        registry_s = self.engine.registry_expiry(owner, group, ttl, now) if wants else 0.0
        keys = [self.keys.lifetime(group), self.registry_key(owner, group)]
        args: list[Any] = [owner, self._ms(ttl), self.engine.grace_ms]
        home = home and group == 0
        if home:
            keys += [self.keys.owners, self.keys.node(ident.node), self.keys.nodes]
            args += ["1", self.engine.liveness, ident.node_key_part]
        else:
            args += ["0", "0", ""]
        args += [
            TOKEN_MEMORY_MS,
            self._ms(registry_s) if registry_s else 0,
            escape(task_id) if task_id else "-",
        ]
        for w in wants:
            rk = self.resource_keys(w.resource)
            keys += (rk.exclusive, rk.shared, rk.counter)
            args += (w.mode, w.limit, w.resource)
        return AcquireCall(keys, args, group, wants, owner, ttl, home, task_id, now, registry_s)

    def acquire_outcome(self, call: AcquireCall, reply: Sequence[Any]) -> list[Held] | Busy:
        """What acquire.lua's ``reply`` to ``call`` means; records a home call and registry."""
        wants, owner, now = call.wants, call.owner, call.now
        code = int(reply[0])
        if code == AcquireReply.GRACE:
            first = wants[0].resource if wants else "(owner registration)"
            return Busy(first, int(reply[1]) / 1000)
        if code == AcquireReply.BUSY:
            return Busy(wants[int(reply[1]) - 1].resource, int(reply[2]) / 1000)
        if call.home:
            self.engine.registered[owner] = now
        if call.registry_s:
            self.engine.registry_until[(owner, call.group)] = now + call.registry_s
        horizon = self.horizon(call.ttl)
        # before the call counts as ended: a recovery must never take these for orphans
        for w, token in zip(wants, reply[1:], strict=True):
            BOOK.hold(owner, self.resource_keys(w.resource).exclusive, int(token))
        return [
            Held(
                store=self,
                owner=owner,
                resource=w.resource,
                mode=w.mode,
                token=int(token),
                ttl=call.ttl,
                acquired_at=now,
                confirmed_at=now,
                horizon=horizon,
                task_id=call.task_id,
            )
            for w, token in zip(wants, reply[1:], strict=True)
        ]

    def _acquire_replicated(self, call: AcquireCall) -> Any:
        """acquire.lua then ``WAIT``, on one connection in one round trip (see min_replicas).

        A grant that too few replicas confirm is given back before the error is raised: a
        failover to one of them could hand the resource, and the same token, to another.
        """
        target: Any = self.client
        if self.cluster:  # WAIT must go down the same connection as the grant
            target = target.get_redis_connection(target.get_node_from_key(call.keys[0]))

        def queue(pipe: Any) -> None:
            pipe.execute_command(
                "EVALSHA", self._acquire.sha, len(call.keys), *call.keys, *call.args
            )
            pipe.execute_command(*self.wait_replicas)

        reply, acked = self._pipeline(target, queue, _scripts.ACQUIRE)
        if int(reply[0]) == AcquireReply.GRANTED and int(acked) < self.settings.min_replicas:
            granted = self.acquire_outcome(call, reply)
            if not isinstance(granted, Busy):
                self.release(granted)
            self.check_replicated(acked, "grant")
        return reply

    def acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        wait: float | None = 0.0,
        task_id: str | None = None,
    ) -> list[Held]:
        """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

        A waiter subscribes to the release channels of every resource it wants, then tries
        again; it is woken by a release at once (no polling), and by the blocking holder's
        expiry at the latest, since each failed attempt says when that holder runs out.
        While it waits it holds none of the resources.

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        start = time.monotonic()
        outcome = self.try_acquire(wants, ident, ttl, task_id)
        if not isinstance(outcome, Busy):
            return outcome
        if wait is not None and wait <= 0:
            raise LeaseBusy(
                outcome.resource,
                retry_after=outcome.wait,
                holder_task=self.holder_task(outcome.resource),
            )
        deadline = math.inf if wait is None else start + wait
        channels = sorted({self.resource_keys(w.resource).channel for w in wants})
        with self._backend("wait for a release"):
            pubsub = self._take_pubsub()
            healthy = False
            try:
                pubsub.subscribe(*channels)
                self._await_subscribed(pubsub, channels)
                while True:
                    outcome = self.try_acquire(wants, ident, ttl, task_id)
                    if not isinstance(outcome, Busy):
                        healthy = True
                        return outcome
                    now = time.monotonic()
                    if now >= deadline:
                        healthy = True
                        raise LeaseBusy(
                            outcome.resource,
                            retry_after=outcome.wait,
                            waited=now - start,
                            holder_task=self.holder_task(outcome.resource),
                        )
                    # woken by a release, or by the blocking holder's expiry at the latest;
                    # a message of an earlier wait on this connection costs one extra attempt
                    pubsub.get_message(timeout=min(deadline - now, outcome.wait + EXPIRY_SLACK))
            finally:
                if healthy:
                    self._give_back_pubsub(pubsub, channels)
                else:
                    pubsub.close()

    def _take_pubsub(self) -> redis.client.PubSub:
        """An idle subscriber connection of this process, or a new one.

        Waiters keep their connections: opening one costs redis-py's handshake (several round
        trips), which a waiter would otherwise pay on every wait.
        """
        client = self.client
        with self._lock:
            if self._pubsub_pid == self._pid and self._pubsubs:
                return self._pubsubs.pop()
        pubsub: redis.client.PubSub = client.pubsub()  # type: ignore[no-untyped-call]
        return pubsub

    def _give_back_pubsub(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        # UNSUBSCRIBE is sent, not waited for: its confirmations (and any late message) are
        # skipped by the next waiter's _await_subscribed
        try:
            pubsub.unsubscribe(*channels)  # type: ignore[no-untyped-call]
        except RedisError:
            pubsub.close()
            return
        with self._lock:
            if self._pubsub_pid != self._pid:
                self._pubsubs, self._pubsub_pid = [], self._pid
            if len(self._pubsubs) < _IDLE_SUBSCRIBERS:
                self._pubsubs.append(pubsub)
                return
        pubsub.close()

    def _await_subscribed(self, pubsub: redis.client.PubSub, channels: list[str]) -> None:
        # The subscription must be in force before the next attempt: a release that comes
        # between a failed attempt and a late SUBSCRIBE would otherwise go unheard.
        deadline = time.monotonic() + self.settings.socket_timeout
        waiting = set(channels)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RedisTimeoutError("no SUBSCRIBE confirmation")
            message = pubsub.get_message(timeout=left)
            if message is not None and message.get("type") == "subscribe":
                waiting.discard(str(message.get("channel")))

    # --- renew ----------------------------------------------------------------------------
    def renew(self, held: Sequence[Held], owner: str, timeout: float) -> set[int]:
        """Renew ``held`` (all of one owner) and refresh the owner's liveness.

        One script call per slot group, sent together in one round trip. The reply must come
        within ``timeout`` seconds, else :class:`LeaseBackendError` (the heartbeat uses the
        time left before the first lease would count as lost).

        Returns:
            the indices (into ``held``) of leases Redis no longer has for us.
        """
        plan = self.renew_calls(held, owner)
        # idempotent after a lost reply: its own connections never retry (the caller hears of
        # the failure), and the next renewal runs it again, token-checked; run twice it only
        # extends the same leases twice
        replies = self._call_with_deadline(
            self._renew.sha, _scripts.RENEW, [(k, a) for _, k, a in plan.calls], timeout
        )
        return self.renew_outcome(plan, replies, owner)

    def renew_calls(self, held: Sequence[Held], owner: str) -> RenewPlan:
        """The renew.lua calls of :meth:`renew`, one per slot group (no Redis call)."""
        by_group: dict[int, list[int]] = {0: []}
        for i, h in enumerate(held):
            by_group.setdefault(h.group, []).append(i)
        longest = max([h.ttl for h in held] + [self.settings.ttl])
        sent = time.monotonic()
        # A registry's expiry is never cut short here: another renewer of the same owner (the
        # asyncio heartbeat next to the thread, or the other way round) may hold longer leases
        # in it. t0 the thread renews a lease of ttl=3600 (registry: 4 h); t1 the asyncio
        # heartbeat renews one of ttl=30 (registry: 2 min); t2 the process dies; t3 the registry
        # runs out, and no cleanup finds the first lease for the next hour.
        registry: dict[int, float] = {}
        calls: list[tuple[list[int], list[str], list[Any]]] = []
        for group, idx in sorted(by_group.items()):
            left = self.engine.registry_until.get((owner, group), 0.0) - sent
            registry[group] = max(4 * longest, left)
            keys = [self.registry_key(owner, group)]
            args: list[Any] = [owner, self._ms(registry[group])]
            if group == 0:
                node = escaped_node_of_owner(owner)
                keys += [self.keys.owners, self.keys.node(unescape(node)), self.keys.nodes]
                args += ["1", self.engine.liveness, node]
            else:
                args += ["0", 0, ""]
            for i in idx:
                h = held[i]
                rk = self.resource_keys(h.resource)
                keys.append(rk.exclusive if h.mode == "x" else rk.shared)
                args += [
                    h.mode,
                    h.token,
                    self._ms(h.ttl),
                    entry_text(h.mode, h.token, h.task_id, h.resource),
                ]
            calls.append((idx, keys, args))
        return RenewPlan(calls, sent, registry)

    def renew_outcome(self, plan: RenewPlan, replies: Sequence[Any], owner: str) -> set[int]:
        """The indices of the leases renew.lua's ``replies`` report lost; records the renewal."""
        lost: set[int] = set()
        for (idx, _, _), reply in zip(plan.calls, replies, strict=True):
            lost.update(idx[int(n) - 1] for n in reply)
        # this call refreshed the owner's liveness and its registries' expiry
        sent = plan.sent
        self.engine.registered[owner] = max(self.engine.registered.get(owner, sent), sent)
        for group, registry_s in plan.registry.items():
            self.engine.registry_until[(owner, group)] = sent + registry_s
        return lost

    def _call_with_deadline(
        self, sha: str, source: str, calls: Sequence[tuple[list[str], list[Any]]], timeout: float
    ) -> list[Any]:
        """EVALSHA each of ``calls`` within ``timeout``: one round trip per Redis node.

        redis-py applies one socket timeout to every command of a connection; the heartbeat
        needs a deadline per call instead, so it drives connections of its own directly: one
        for one server or a Sentinel master, one per node on a cluster (each call's keys
        share one slot, so its first key says which node).
        """
        end = time.monotonic() + timeout
        with self._backend("renew"):
            if not self._renew_lock.acquire(timeout=timeout):
                raise RedisTimeoutError(f"another renewal still runs after {timeout:.2f}s")
            try:
                routes: dict[str, list[int]] = {}
                for i, (keys, _) in enumerate(calls):
                    routes.setdefault(self._node_of(keys[0]), []).append(i)
                conns = {
                    node: self._renewal_connection(node, max(0.0, end - time.monotonic()))
                    for node in routes
                }
                replies: list[Any] = [None] * len(calls)
                try:
                    # every node gets its commands before any reply is read
                    for node, idx in routes.items():
                        self._send(conns[node], sha, [calls[i] for i in idx])
                    for node, idx in routes.items():
                        got = self._read(conns[node], sha, source, [calls[i] for i in idx], end)
                        for i, reply in zip(idx, got, strict=True):
                            replies[i] = reply
                except BaseException as exc:
                    for conn in conns.values():
                        conn.disconnect()
                    if self.cluster and isinstance(exc, (MovedError, RedisConnectionError)):
                        self._refresh_slots()
                    raise
                return replies
            finally:
                self._renew_lock.release()

    def _node_of(self, key: str) -> str:
        """The name of the cluster node serving ``key`` ("" off a cluster)."""
        if not self.cluster:
            return ""
        node = self.client.get_node_from_key(key)  # type: ignore[attr-defined]
        return str(node.name)

    def _refresh_slots(self) -> None:
        """After a MOVED reply or a lost node: read the cluster's slot map again."""
        with suppress(RedisError):  # the next renewal tries again
            self.client.nodes_manager.initialize()  # type: ignore[attr-defined]

    def _renewal_connection(self, node: str, timeout: float) -> Any:
        """This process's renewal connection to ``node``, opened (if it is not) within ``timeout``.

        Not a pooled one: t0 Redis freezes while every pooled connection is in use; t1 the
        renewal needs a new connection, and redis-py's handshake (CLIENT SETNAME, ...) waits
        for the full socket timeout; t2 the lease's deadline passes unnoticed; t3 Redis
        expires the lease and hands it on, and only then is the holder told. Its own
        connection, opened with the renewal's deadline as its timeouts, cannot stall so.
        Under Sentinel it asks the sentinels for the master each time it (re)connects.
        """
        pid = os.getpid()
        if self._renew_pid != pid:
            self._renew_conns, self._renew_pid = {}, pid
        conn = self._renew_conns.get(node)
        if conn is None:
            if self.cluster:
                cluster_node = self.client.get_node(node_name=node)  # type: ignore[attr-defined]
                pool = self.client.get_redis_connection(cluster_node).connection_pool  # type: ignore[attr-defined]
            else:
                pool = self.client.connection_pool
            kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
            conn = self._renew_conns[node] = pool.connection_class(**kwargs)
        if getattr(conn, "_sock", None) is None:
            conn.socket_connect_timeout = conn.socket_timeout = max(timeout, 0.001)
            conn.connect()
        return conn

    def _send(self, conn: Any, sha: str, calls: Sequence[tuple[list[str], list[Any]]]) -> None:
        commands: list[tuple[Any, ...]] = [("EVALSHA", sha, len(k), *k, *a) for k, a in calls]
        if self.wait_replicas:
            commands.append(self.wait_replicas)
        conn.send_packed_command(conn.pack_commands(commands))

    def _read(
        self,
        conn: Any,
        sha: str,
        source: str,
        calls: Sequence[tuple[list[str], list[Any]]],
        end: float,
    ) -> list[Any]:
        """The replies to what :meth:`_send` sent ``conn``, each by ``end`` (monotonic)."""
        replies = [self._read_one(conn, end) for _ in calls]
        if self.wait_replicas:
            self.check_replicated(self._read_one(conn, end), "renewal")
        if any(isinstance(r, NoScriptError) for r in replies):
            # Redis restarted or SCRIPT FLUSH ran: load it and send again, same deadline
            conn.send_command("SCRIPT", "LOAD", source)
            self._read_one(conn, end)
            self._send(conn, sha, calls)
            return self._read(conn, sha, source, calls, end)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    @staticmethod
    def _read_one(conn: Any, end: float) -> Any:
        left = end - time.monotonic()
        if left <= 0 or not conn.can_read(timeout=left):
            raise RedisTimeoutError("no reply before the renewal's deadline")
        try:
            return conn.read_response()
        except NoScriptError as exc:
            return exc  # the other replies must still be read off the connection

    def check_replicated(self, acked: Any, what: str) -> None:
        """Raise ReplicaShortfall when WAIT's ``acked`` is below min_replicas."""
        self.engine.check_replicated(acked, what)

    # --- release --------------------------------------------------------------------------
    def release(self, held: Sequence[Held]) -> list[bool]:
        """Release ``held`` (any owners); True for each lease that was still ours.

        Idempotent: releasing a lease again, or one that already ran out, returns False and
        changes nothing but the registry entry.
        """
        if not held:
            return []
        return self.run(_grants.release(self.engine, held, time.monotonic()))

    def _release_entries(
        self,
        owner: str,
        group: int,
        entries: Sequence[Entry],
        counted: Sequence[bool] | None = None,
    ) -> list[bool]:
        """release.lua for ``entries`` (see :func:`_grants.release_entries`)."""
        return self.run(_grants.release_entries(self.engine, owner, group, entries, counted))

    # --- cleanup --------------------------------------------------------------------------
    def cleanup_owner(
        self,
        owner: str,
        *,
        dead: bool = False,
        granted_before_us: int | None = None,
        clock_offsets_us: Sequence[int] | None = None,
    ) -> CleanupReport:
        """Release every lease ``owner`` still holds, in O(leases it held).

        Reads the owner's registry in each slot group (one SMEMBERS each), releases what is
        listed (one script call each), then forgets the owner unless its liveness was
        refreshed meanwhile; ``dead=True`` forgets it regardless (its node restarted).
        Registry entries that cannot be parsed are kept and reported, never dropped.

        With ``granted_before_us`` (Redis time in microseconds), only leases granted before
        it are released: a token is at least the Redis clock of its grant, so an entry with
        a token from then on was granted later, to an owner that is alive again. On a
        cluster that time is read on the home group's node while the tokens of group ``g``
        are made on the clock of the node serving ``g``: ``clock_offsets_us[g]`` (see
        :meth:`clocks_us`) is added to it for the entries of group ``g``.
        """
        report = CleanupReport(owners=[owner])
        spared = False
        for group in range(self.settings.slot_groups):
            key = self.keys.registry(owner, group)
            with self._backend("read an owner registry"):
                members = self.client.smembers(key)
            before = granted_before_us
            if before is not None and clock_offsets_us is not None:
                before += clock_offsets_us[group]
            entries: list[Entry] = []
            for member in sorted(members):
                parsed = parse_entry(str(member))
                if parsed is None:
                    report.kept.append((owner, str(member)))
                elif before is not None and parsed.token >= before:
                    spared = True
                else:
                    entries.append(parsed)
            # in batches, so that a dead owner of thousands of leases never blocks Redis long
            for start in range(0, len(entries), _RELEASE_BATCH):
                batch = entries[start : start + _RELEASE_BATCH]
                freed = self._release_entries(owner, group, batch)
                for entry, was_held in zip(batch, freed, strict=True):
                    if was_held:
                        report.released.append((owner, entry.resource))
                        report.freed.append((owner, entry))
                    else:
                        report.expired += 1
        if not report.kept and not spared:
            node = node_of_owner(owner)
            # idempotent (ZREM, SREM): redis-py's own retry may run it twice
            with self._backend("forget an owner"):
                self._forget_owner(
                    [self.keys.owners, self.keys.node(node), self.keys.nodes],
                    [owner, escaped_node_of_owner(owner), "1" if dead else "0"],
                    client=self.client,
                )
        return report

    def cleanup_node(self, node: str, *, keep_incarnation: str | None = None) -> CleanupReport:
        """Release every lease of earlier incarnations of ``node`` (a restarted pod).

        A node with no past costs one command (SMEMBERS of its owner set). Each owner is
        cleaned on its own, so one failure does not stop the others.
        """
        with self._backend("list a node's owners"):
            owners = sorted(str(o) for o in self.client.smembers(self.keys.node(node)))
        report = CleanupReport()
        for owner in owners:
            if split_owner(owner).incarnation == keep_incarnation:
                continue
            report.merge(self.cleanup_owner_isolated(owner, dead=True))
        return report

    def expired_owners(self, limit: int = 1000) -> list[str]:
        """Owners whose liveness ran out (by the Redis clock), oldest first."""
        return [owner for owner, _ in self._expired_owner_times(limit)]

    def _expired_owner_times(self, limit: int) -> list[tuple[str, int]]:
        """``(owner, Redis time in ms its liveness ran out)``, oldest first."""
        with self._backend("list expired owners"):  # a read: redis-py's retry is harmless
            reply = self._expired_owners([self.keys.owners], [limit], client=self.client)
        return [(str(reply[i]), int(float(reply[i + 1]))) for i in range(0, len(reply), 2)]

    def reconcile(self, limit: int = 1000) -> CleanupReport:
        """Release the leases of owners whose liveness ran out (orphans), each on its own.

        Only leases granted before the owner's liveness ran out are released. Timeline: t0 an
        idle process's liveness runs out (it holds nothing, so nothing renews it); t1 this
        pass lists it; t2 the process takes a lease, alive again; t3 this pass reaches it and
        must not free the lease of t2.
        """
        report = CleanupReport()
        expired = self._expired_owner_times(limit)
        offsets = self.clocks_us()[1] if expired else None
        for owner, expired_ms in expired:
            report.merge(
                self.cleanup_owner_isolated(
                    owner,
                    dead=False,
                    granted_before_us=expired_ms * 1000,
                    clock_offsets_us=offsets,
                )
            )
        return report

    def clocks_us(self) -> tuple[int, list[int] | None]:
        """The Redis clock of the home group's node, in microseconds, and per slot group how
        far the clock of the node serving it is ahead of that one, at the least (None off a
        cluster: one clock). A cleanup's ``granted_before_us`` and ``clock_offsets_us``.

        The liveness a reconcile compares tokens with is made on the home group's node; a
        token of group ``g`` on the clock of another node. Timeline, with that node 5 ms
        behind: t0 an idle owner's liveness runs out (home node's clock E); t1 = E + 2 ms the
        owner, alive again, is granted a lease in ``g`` with token E - 3 ms; t2 a reconcile
        frees every lease of that owner granted before E, this one too. Both clocks are read
        in one round trip, and its length is taken off the difference, so the offset is never
        larger than the true one: a lease is then spared rather than wrongly freed.
        """
        if not self.cluster:
            return math.floor(self.redis_time() * 1_000_000), None
        groups = range(self.settings.slot_groups)

        def queue(pipe: Any) -> None:
            for group in groups:
                pipe.execute_command("EVALSHA", self._now_sha, 1, self.keys.epoch(group))

        with self._backend("read the cluster's clocks"):
            start = time.monotonic()
            replies = self._pipeline(self.client, queue, NOW_SCRIPT)
            spread_us = math.ceil((time.monotonic() - start) * 1_000_000)
        clocks = [int(sec) * 1_000_000 + int(usec) for sec, usec in replies]
        return clocks[0], [0] + [clock - clocks[0] - spread_us for clock in clocks[1:]]

    def node_owners(self, node: str) -> list[str]:
        """The owner ids registered under ``node`` (every incarnation and process)."""
        with self._backend("list a node's owners"):
            return sorted(str(o) for o in self.client.smembers(self.keys.node(node)))

    def cleanup_owner_isolated(
        self,
        owner: str,
        *,
        dead: bool,
        granted_before_us: int | None = None,
        clock_offsets_us: Sequence[int] | None = None,
    ) -> CleanupReport:
        """:meth:`cleanup_owner`, with a failure reported in the result instead of raised."""
        try:
            return self.cleanup_owner(
                owner,
                dead=dead,
                granted_before_us=granted_before_us,
                clock_offsets_us=clock_offsets_us,
            )
        except LeaseBackendError as exc:
            return CleanupReport(owners=[owner], errors=[(owner, str(exc))])

    # --- operations (cli) -----------------------------------------------------------------
    # Read and repair calls for operators (``celery leases ...``). Each walks the owners index
    # and the owners' registries, never the keyspace, and batches its commands in pipelines.

    def read_registries(self, owners: Sequence[str]) -> dict[str, list[Entry]]:
        """The registry entries of each of ``owners`` (every slot group), by resource name.

        Pipelined: one round trip per :data:`_OPS_BATCH` registries. Unreadable entries are
        left out here; a cleanup keeps and reports them.
        """
        out: dict[str, list[Entry]] = {owner: [] for owner in owners}
        keys = [
            (owner, self.keys.registry(owner, group))
            for owner in out
            for group in range(self.settings.slot_groups)
        ]
        with self._backend("read owner registries"):
            for start in range(0, len(keys), _OPS_BATCH):
                chunk = keys[start : start + _OPS_BATCH]
                pipe = self.client.pipeline(transaction=False)
                for _, key in chunk:
                    pipe.smembers(key)
                for (owner, _), members in zip(chunk, pipe.execute(), strict=True):
                    for member in members:
                        parsed = parse_entry(str(member))
                        if parsed is not None:
                            out[owner].append(parsed)
        for entries in out.values():
            entries.sort(key=lambda e: (e.resource, e.token))
        return out

    def check_entries(self, items: Sequence[tuple[str, Entry]]) -> list[float | None]:
        """For each ``(owner, entry)``: the seconds left on that lease, or None if it is gone.

        A lease is there while its key still names the entry's token and owner (the test
        renew.lua makes); None means it ran out, was released or was taken over since, and
        the registry entry is stale.
        """
        out: list[float | None] = []
        with self._backend("inspect leases"):
            for start in range(0, len(items), _OPS_BATCH):
                chunk = items[start : start + _OPS_BATCH]

                def build(pipe: Any, chunk: Sequence[tuple[str, Entry]] = chunk) -> None:
                    for owner, entry in chunk:
                        rk = self.resource_keys(entry.resource)
                        if entry.mode == "x":
                            pipe.get(rk.exclusive)
                            pipe.pttl(rk.exclusive)
                        else:
                            pipe.zscore(rk.shared, f"{entry.token} {owner}")

                replies, now_ms = self._with_now(build, self.keys.owners)
                replies.reverse()
                for owner, entry in chunk:
                    if entry.mode == "x":
                        value, pttl = replies.pop(), replies.pop()
                        held = value is not None and str(value) == f"{entry.token} {owner}"
                        out.append(max(int(pttl), 0) / 1000 if held else None)
                    else:
                        score = replies.pop()
                        held = score is not None and float(score) > now_ms
                        out.append((float(score) - now_ms) / 1000 if held else None)
        return out

    def _with_now(self, build: Callable[[Any], object], key: str) -> tuple[list[Any], int]:
        """Run the commands ``build`` queues in one pipeline, with the Redis clock in ms.

        The clock is read on the node serving ``key``, by a one-line script: a cluster
        pipeline cannot send TIME (it names no key).
        """

        def queue(pipe: Any) -> None:
            build(pipe)
            pipe.execute_command("EVALSHA", self._now_sha, 1, key)

        replies = self._pipeline(self.client, queue, NOW_SCRIPT)
        sec, usec = replies.pop()
        return replies, int(sec) * 1000 + int(usec) // 1000

    @staticmethod
    def _pipeline(target: Any, queue: Callable[[Any], object], script: str) -> list[Any]:
        """One round trip of the commands ``queue`` puts in a pipeline of ``target``.

        If Redis lost ``script`` (a restart, SCRIPT FLUSH), it is loaded (on every primary of
        a cluster) and the pipeline sent once more. The first error reply is raised.
        """
        for attempt in (1, 2):
            pipe = target.pipeline(transaction=False)
            queue(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies):
                target.script_load(script)
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def read_liveness(self, owners: Sequence[str]) -> dict[str, float | None]:
        """Seconds left on each owner's liveness (negative: it ran out; None: not registered)."""
        out: dict[str, float | None] = {}
        unique = list(dict.fromkeys(owners))
        with self._backend("read owner liveness"):
            for start in range(0, len(unique), _OPS_BATCH):
                chunk = unique[start : start + _OPS_BATCH]

                def build(pipe: Any, chunk: list[str] = chunk) -> None:
                    pipe.zmscore(self.keys.owners, chunk)

                (scores,), now_ms = self._with_now(build, self.keys.owners)
                for owner, score in zip(chunk, scores, strict=True):
                    out[owner] = None if score is None else (float(score) - now_ms) / 1000
        return out

    def force_release(self, resource: str, holder: Holder) -> bool:
        """Release ``holder``'s lease on ``resource``, whoever holds it; True if it was held.

        Only that grant goes: the key must still name the holder's token and owner, so a lease
        granted to someone else in between is never touched. The registry entry goes too, and
        waiters are woken. A live holder learns of it at its next renewal (``LeaseLost``).
        """
        task_id = next(
            (
                e.task_id
                for e in self.entries(holder.owner)
                if (e.resource, e.mode, e.token) == (resource, holder.mode, holder.token)
            ),
            None,
        )
        entry = Entry(holder.mode, holder.token, task_id, resource)
        return self._release_entries(holder.owner, self.resource_keys(resource).group, [entry])[0]

    def audit(self, record: Mapping[str, object]) -> None:
        """Append ``record`` (JSON-serialisable) to the audit list; the newest are kept."""
        text = json.dumps(dict(record), sort_keys=True)
        with self._backend("write the audit log"):
            pipe = self.client.pipeline(transaction=True)
            pipe.lpush(self.keys.audit, text)
            pipe.ltrim(self.keys.audit, 0, AUDIT_KEEP - 1)
            pipe.execute()

    def audit_log(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` audit records, newest first (an unreadable one as ``{"raw": text}``)."""
        if n <= 0:
            return []
        with self._backend("read the audit log"):
            texts = self.client.lrange(self.keys.audit, 0, n - 1)
        out: list[dict[str, Any]] = []
        for text in texts:
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            out.append(record if isinstance(record, dict) else {"raw": str(text)})
        return out

    # --- inspect --------------------------------------------------------------------------
    def holders(self, resource: str) -> list[Holder]:
        """Who holds ``resource`` now (exclusive holder or live shared holders)."""
        rk = self.resource_keys(resource)
        xkey, skey = rk.exclusive, rk.shared
        with self._backend("inspect a resource"):

            def build(pipe: Any) -> None:
                pipe.get(xkey)
                pipe.pttl(xkey)
                pipe.zrange(skey, 0, -1, withscores=True)

            (value, pttl, shared), now_ms = self._with_now(build, skey)
        out: list[Holder] = []
        if value is not None:
            token, owner = holder_parts(value)
            out.append(Holder(resource, "x", int(token), owner, max(int(pttl), 0) / 1000))
        for member, score in shared:
            if score > now_ms:
                token, owner = holder_parts(member)
                out.append(Holder(resource, "s", int(token), owner, (score - now_ms) / 1000))
        return out

    def owners(self) -> list[tuple[str, float]]:
        """Every registered owner and the seconds left on its liveness (negative: dead)."""
        with self._backend("list owners"):
            (members,), now_ms = self._with_now(
                lambda pipe: pipe.zrange(self.keys.owners, 0, -1, withscores=True),
                self.keys.owners,
            )
        return [(str(m), (s - now_ms) / 1000) for m, s in members]

    def owned(self, owner: str) -> list[tuple[str, int, str]]:
        """``(mode, token, resource)`` of what ``owner``'s registries list."""
        return [(e.mode, e.token, e.resource) for e in self.entries(owner)]

    def entries(self, owner: str) -> list[Entry]:
        """The registry entries of ``owner`` (every slot group), by resource name."""
        out: list[Entry] = []
        with self._backend("read an owner registry"):
            pipe = self.client.pipeline(transaction=False)
            for group in range(self.settings.slot_groups):
                pipe.smembers(self.keys.registry(owner, group))
            for members in pipe.execute():
                for member in members:
                    parsed = parse_entry(str(member))
                    if parsed is not None:
                        out.append(parsed)
        return sorted(out, key=lambda e: (e.resource, e.token))

    def nodes(self) -> list[str]:
        """Every node that has registered owners."""
        with self._backend("list nodes"):
            return sorted(unescape(str(n)) for n in self.client.smembers(self.keys.nodes))

    # --- once receipts -------------------------------------------------------------------
    def get_receipt(self, name: str) -> str | None:
        """The stored receipt (JSON text) of ``once(name)``, or None."""
        return self.run(_grants.get_receipt(self.engine, name))

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

    # --- unique claims (see _claims) ----------------------------------------------------------
    def unique_claim(self, key: str, task_id: str, ttl: float) -> Claimed | ClaimHolder:
        """Claim ``key`` for ``task_id``, about to be published, for ``ttl`` seconds.

        Returns:
            :class:`Claimed` (``again`` when it was already queued for this task id), or the
            :class:`ClaimHolder` that has it.
        """
        return self.run(_claims.unique_claim(self.engine, key, task_id, ttl))

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
        """Take over ``key``'s claim for ``task_id``, waiting where waiting can help.

        While the claim is held by a run of this same task id in another process (a
        redelivered message; the first run may be dead and its lease about to be freed) or
        Redis is in its restart grace, wait up to ``wait`` seconds, woken by the claim's
        release (no polling) or the holder's expiry. A claim of another task id is answered
        at once: waiting cannot make it ours.
        """
        start = time.monotonic()
        outcome = self.unique_handover(key, task_id, ident, ttl)
        if isinstance(outcome, Held) or not outcome.waits_for(task_id) or wait <= 0:
            return outcome
        deadline = start + wait
        channel = self.resource_keys(self.keys.unique_resource(key)).channel
        with self._backend("wait for a unique claim"):
            pubsub = self._take_pubsub()
            healthy = False
            try:
                pubsub.subscribe(channel)
                self._await_subscribed(pubsub, [channel])
                while True:
                    outcome = self.unique_handover(key, task_id, ident, ttl)
                    now = time.monotonic()
                    if isinstance(outcome, Held) or not outcome.waits_for(task_id):
                        healthy = True
                        return outcome
                    if now >= deadline:
                        healthy = True
                        return outcome
                    pause = deadline - now
                    if outcome.expires_in is not None:
                        pause = min(pause, outcome.expires_in + EXPIRY_SLACK)
                    pubsub.get_message(timeout=pause)
            finally:
                if healthy:
                    self._give_back_pubsub(pubsub, [channel])
                else:
                    pubsub.close()

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
        """The task id of the exclusive holder of ``resource``, for a busy error's message.

        Only the busy path pays for it (two reads). None when the resource is held shared,
        not by a task, not at all any more, or when Redis fails: a busy error must stay a
        busy error, not become a backend error over a detail of its message.
        """
        try:
            holder = split_holder(self.client.get(self.resource_keys(resource).exclusive))
            if holder is None or isinstance(holder, str):
                return holder
            return self._registry_task(holder[0], resource, holder[1])
        except (RedisError, LeaseBackendError) as exc:
            logger.debug("leases: could not read the holder of %s: %s", resource, exc)
            return None

    def _registry_task(self, owner: str, resource: str, token: int) -> str | None:
        """The task id ``owner``'s registry records for its lease ``resource``/``token``."""
        return self.run(_claims.registry_task(self.engine, owner, resource, token))


def settle_lost_grant(
    owner: str,
    wants: Sequence[tuple[str, str]],
    book: Sequence[str],
    replies: Sequence[Any],
    now_ms: int,
    adopt_until: float,
    task_id: str | None,
) -> tuple[list[int] | None, list[Entry]]:
    """What a grant whose reply was lost left, read back: ``(tokens adopted, orphans)``.

    The decision both stores' ``recover_grant`` make once Redis was read quietly (see
    :func:`~celery_leases._lostreply.grant_recovery`): the lost call's grant is adopted, or
    the orphan grants of ``owner`` (no live lease of this process has their token) are to be
    released by the caller. ``book``: the resources' keys in the :data:`BOOK`.
    """
    found, entries = own_grants(owner, [r for r, _ in wants], replies, now_ms)
    held = {r: BOOK.held(owner, k) for (r, _), k in zip(wants, book, strict=True)}
    decision = grant_recovery(
        wants,
        found,
        held,
        alone=BOOK.alone(owner, book),
        may_adopt=time.monotonic() < adopt_until,
    )
    if decision.adopt is not None:
        logger.info("leases: a grant of %s whose reply was lost is kept", wants[0][0])
        return decision.adopt, []
    orphans = [entries.get((r, m, t)) or Entry(m, t, task_id, r) for r, m, t in decision.give_back]
    if orphans:
        logger.info(
            "leases: %d grant(s) whose reply was lost are given back (%s)",
            len(orphans),
            ", ".join(repr(e.resource) for e in orphans),
        )
    return None, orphans


def own_grants(
    owner: str, resources: Sequence[str], replies: Sequence[Any], now_ms: int
) -> tuple[dict[str, list[tuple[str, int]]], dict[tuple[str, str, int], Entry]]:
    """``owner``'s grants in what :meth:`LeaseStore.recover_grant` read back.

    ``replies``: per resource its exclusive key's value and its shared members with their
    expiry (Redis time in ms), then the owner's registry; ``now_ms``: the Redis clock after
    the read. Returns per resource ``(mode, token)`` of the live grants, and the registry
    entries by ``(resource, mode, token)`` (to release them by their exact text).
    """
    found: dict[str, list[tuple[str, int]]] = {}
    for i, resource in enumerate(resources):
        value, members = replies[2 * i], replies[2 * i + 1]
        live = [m for m, score in members if float(score) > now_ms]
        grants = found[resource] = []
        for mode, holder in [("x", value), *(("s", m) for m in live)]:
            parsed = None if holder is None else parse_holder(holder)
            if parsed is not None and parsed[1] == owner:
                grants.append((mode, parsed[0]))
    entries: dict[tuple[str, str, int], Entry] = {}
    for member in replies[-1]:
        entry = parse_entry(str(member))
        if entry is not None:
            entries[(entry.resource, entry.mode, entry.token)] = entry
    return found, entries
