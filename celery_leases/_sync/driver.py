"""LeaseStore: the sync driver of the lease protocol, and the store the package calls.

It carries out the requests of the core operations (``_grants``, ``_cleanup``,
``_inspect``, ``_claims``): a client per process (made anew after a fork, see ``client``),
EVALSHA and NOSCRIPT, redis-py's errors thrown back in as
:class:`~celery_leases._protocol.Failure`, WAIT routing (``replicated``), the lanes
(``lanes``), the renewal lines (``renewals``) and the subscribers (``subscriber``). The
methods that run one operation each are in ``operations``. Its twin is
``_aio/driver.py::AsyncLeaseStore``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisError

from .. import _connect, _grants, _scripts
from .._claims import ClaimHolder, claim_waiting_time
from .._engine import LeaseEngine
from .._grants import Busy, busy_error, waiting_time
from .._identity import Identity
from .._lease import Held, Want
from .._one_attempt import failure_of, one_attempt
from .._protocol import Command, Op, Script, Send, SendReplicated, SendWithin, Sleep, Steps, drive
from ..config import LeaseSettings
from ..exceptions import LeaseBackendError
from .client import make_client, node_of, send_op
from .lanes import Lanes
from .operations import Operations
from .renewals import RenewalLines
from .replicated import send_replicated
from .subscriber import Subscriber

T = TypeVar("T")

__all__ = ("LeaseStore",)


class LeaseStore(Operations):
    """Acquire, renew, release, clean up and inspect leases in one Redis, under one prefix.

    Clients are made lazily in each process and made anew after a fork. Every redis error is
    raised as :class:`~celery_leases.exceptions.LeaseBackendError`.
    """

    def __init__(self, settings: LeaseSettings, *, engine: LeaseEngine | None = None) -> None:
        self.settings = settings
        #: the protocol's memory in this process (pass the asyncio driver's to share it)
        self.engine = engine = LeaseEngine(settings) if engine is None else engine
        self.keys = engine.keys
        self.url = settings.url
        self._lock = threading.Lock()
        self._subscribers = Subscriber(lambda: self.client, settings.socket_timeout)
        self._renewals = RenewalLines(engine, lambda: self.client)
        self._lanes = Lanes()
        # the client object connects lazily; made now so a bad URL fails at start-up, and so
        # the scripts are registered before any method can reach for them
        self._target = _connect.parse_target(self.url)
        self._client: redis.Redis | None = make_client(self._target, self.keys, settings)
        #: True on a Redis Cluster (grants, renewals and cleanups go per node there)
        self.cluster = engine.cluster
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
                self._client = make_client(self._target, self.keys, self.settings)
                self._pid = pid
                self.engine.forked()
            return self._client

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

    def load_scripts(self) -> dict[str, str]:
        """``SCRIPT LOAD`` every script; returns name -> SHA (proves the wheel ships them)."""
        with self._backend("load scripts"):
            return {name: self.client.script_load(src) for name, src in _scripts.ALL.items()}

    # --- the driver -----------------------------------------------------------------------
    def run(self, steps: Steps[T]) -> T:
        """Carry out a core operation: each request it yields, sent; each reply, sent back.

        A redis error is thrown into it as :class:`~celery_leases._protocol.Failure`.
        """
        return drive(steps, self._execute, RedisError, failure_of)

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
                    return send_op(self.client, op)
            return send_op(self.client, op)
        if type(op) is SendReplicated:
            with one_attempt():
                return send_replicated(self.client, self.engine, op.calls)
        if type(op) is SendWithin:
            return self._renewals.send(op.calls, op.timeout)
        if type(op) is Sleep:
            time.sleep(op.seconds)
            return None
        raise TypeError(f"not a request of the lease protocol: {op!r}")

    def acquire(
        self,
        wants: Sequence[Want],
        ident: Identity,
        ttl: float,
        wait: float | None = 0.0,
        task_id: str | None = None,
    ) -> list[Held]:
        """Acquire all of ``wants`` or none, waiting up to ``wait`` seconds (None: no limit).

        A waiter takes a ticket, subscribes to its own channel (and the release channels of
        every resource it wants), then tries again. A busy attempt queues the ticket at the
        resource that blocks it (lua/_waiters.lua): a release wakes the head of that queue
        alone, at once (no polling), and the blocking holder's expiry wakes it at the latest,
        since each failed attempt says when that holder runs out. Within a slot group,
        waiters are served first come, first served. While it waits it holds none of the
        resources; when it stops waiting without a grant it leaves the queues.

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        start = time.monotonic()
        outcome = self.run(_grants.try_acquire(self.engine, wants, ident, ttl, task_id))
        if not isinstance(outcome, Busy):
            return outcome
        if wait is not None and wait <= 0:
            raise busy_error(outcome, self.holder_task(outcome.resource))
        deadline = math.inf if wait is None else start + wait
        # a place in the waiter queues: woken alone, on its own channel, when its turn comes
        # (and handed the lease there, when it is one exclusive lease: see lua/release.lua)
        ticket = _grants.new_ticket(self.engine, wants, ident.owner, ttl, task_id)

        def attempt() -> float | None:
            nonlocal outcome
            outcome = self.run(_grants.try_acquire(self.engine, wants, ident, ttl, task_id, ticket))
            return waiting_time(outcome, time.monotonic(), deadline)

        channels = sorted({self.resource_keys(w.resource).channel for w in wants})
        mine = self.keys.waiter_channel(ticket.id)
        channels.append(mine)
        done = False
        try:
            with self._backend("wait for a release"), _grants.ordering(self.engine, wants, ticket):
                token = self._subscribers.wait(channels, attempt, mine, ticket.accepts)
                if token is not None:
                    outcome = _grants.handed(self.engine, wants, ttl, ticket, token)
            done = True
        finally:
            if not done:  # failed or interrupted: it may be queued anywhere it waited
                ticket.queued = {w.resource for w in wants}
            if ticket.queued:  # timed out (or failed): leave, and wake the next waiter
                self.run(_grants.leave_queues(self.engine, wants, ticket))
        if isinstance(outcome, Busy):
            waited = time.monotonic() - start
            raise busy_error(outcome, self.holder_task(outcome.resource), waited)
        return outcome

    def node_of(self, key: str) -> str:
        """The name of the cluster node serving ``key`` ("" off a cluster)."""
        return node_of(self.client, key, self.cluster)

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

        def attempt() -> float | None:
            nonlocal outcome
            outcome = self.unique_handover(key, task_id, ident, ttl)
            return claim_waiting_time(outcome, task_id, time.monotonic(), deadline)

        channel = self.resource_keys(self.keys.unique_resource(key)).channel
        with self._backend("wait for a unique claim"):
            self._subscribers.wait([channel], attempt)
        return outcome
