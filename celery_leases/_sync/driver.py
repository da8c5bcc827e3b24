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

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisError

from .. import _connect, _scripts, _wait
from .._claims import ClaimHolder
from .._engine import LeaseEngine
from .._identity import Identity
from .._lease import Held, Want
from .._one_attempt import failure_of, one_attempt
from .._protocol import (
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
)
from .._wait import Wait
from ..config import LeaseSettings
from ..exceptions import LeaseBackendError
from .client import make_client, node_of, send_op
from .lanes import Lanes
from .operations import Operations
from .renewals import RenewalLines
from .replicated import send_replicated
from .subscriber import Subscriber

T = TypeVar("T")

__all__ = ("LeaseStore", "Ride")


@dataclass
class Ride:
    """Calls that ride in the round trip of the next grant (see :meth:`LeaseStore.riding`).

    ``replies`` is None until they were sent; ``lost`` is True when that round trip failed
    (they may or may not have run).
    """

    calls: Sequence[Call]
    replies: list[Any] | None = None
    lost: bool = False


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
        self._rides = threading.local()

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

    @contextmanager
    def riding(self, calls: Sequence[Call]) -> Iterator[Ride]:
        """Send ``calls`` in the same round trip as this thread's next grant (the first
        pipeline that carries an ``acquire`` script call), after its calls, within the
        block. A ride that never went (no grant was sent, or it went through WAIT) keeps
        ``replies`` None: the caller sends its calls itself."""
        ride = Ride(calls)
        self._rides.ride = ride
        try:
            yield ride
        finally:
            self._rides.ride = None

    def _riding(self, op: Send) -> Any:
        """Send ``op`` with this thread's ride, if it is a grant; None if it is not."""
        ride: Ride | None = getattr(self._rides, "ride", None)
        if ride is None or op.transaction:
            return None
        if not any(type(c) is Script and c.name == "acquire" for c in op.calls):
            return None
        self._rides.ride = None  # one ride, on the first grant
        both = Send([*op.calls, *ride.calls], once=True)
        try:
            with one_attempt():
                replies = send_op(self.client, both)
        except BaseException:
            ride.lost = True
            raise
        ride.replies = replies[len(op.calls) :]
        return replies[: len(op.calls)]

    def _execute(self, op: Op) -> Any:
        if type(op) is Send:
            rode = self._riding(op)
            if rode is not None:
                return rode
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

        See :func:`_wait.acquire`: woken by a release (no polling), first come, first
        served; it holds nothing while it waits, and leaves the queues when it stops.

        Raises:
            LeaseBusy: still busy when the wait ran out; ``.resource`` names the first busy one.
            LeaseBackendError: Redis failed.
        """
        return self.run_wait(_wait.acquire(self.engine, wants, ident, ttl, wait, task_id))

    def node_of(self, key: str) -> str:
        """The name of the cluster node serving ``key`` ("" off a cluster)."""
        return node_of(self.client, key, self.cluster)

    def unique_take(
        self,
        key: str,
        task_id: str,
        ident: Identity,
        ttl: float,
        wait: float,
        handed: tuple[str, int, str] | None = None,
    ) -> Held | ClaimHolder:
        """Take over ``key``'s claim for ``task_id``, waiting up to ``wait`` seconds where
        waiting can help (see :func:`_wait.unique_take`)."""
        return self.run_wait(_wait.unique_take(self.engine, key, task_id, ident, ttl, wait, handed))

    def wait_until_free(self, resource: str, timeout: float | None) -> bool:
        """Wait until ``resource`` has no holder (True) or ``timeout`` seconds pass (False;
        None: no limit), taking nothing (see :func:`_wait.until_free`)."""
        return self.run_wait(_wait.until_free(self.engine, resource, timeout))
