"""LeaseEngine: what the lease protocol remembers in one process, and its small rules.

One engine per settings, shared by the sync and the asyncio driver of those settings
(which take it; it names neither): the key names (cached), when each owner's liveness and
registries were last refreshed, the beat runs won, and the rules that read them (a lease's
horizon, whether a grant may skip the owner's home call, a registry's expiry). The core operations
(``_grants``, ``_cleanup``, ``_inspect``, ``_claims``) take it as their first argument.
No I/O: nothing here imports redis or asyncio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._connect import parse_target
from ._keys import Keyspace
from ._protocol import Call, Failure, ReplicaShortfall, Script, Send, SendReplicated, Steps
from .config import LeaseSettings, safe_url
from .exceptions import LeaseBackendError

__all__ = ("OFF", "RESOURCE_HISTORY", "LeaseEngine", "ResourceKeys", "grace_arg", "kept_grace")

#: resources whose key names are cached per engine
_KEY_CACHE_SIZE: Final = 4096


#: events a resource's own history stream keeps, at most (the ``history`` setting caps it too)
RESOURCE_HISTORY: Final = 100


#: the scripts' grace argument when neither case is checked: the record is not even read
OFF: Final = -1


def kept_grace(settings: LeaseSettings) -> float:
    """Seconds nothing is granted after a restart that kept the record (0: not checked).

    ``restore_grace``, or by default the ``ttl`` setting (or ``restart_grace`` if longer): a
    holder counts a lease held for at most ``ttl`` after its last confirmation, whatever the
    lease's own TTL (the owner's liveness is ``ttl``; see :meth:`LeaseEngine.horizon`), so after
    ``ttl`` every holder of a lost grant has found it gone.
    """
    if settings.restore_grace is not None:
        return settings.restore_grace
    return max(settings.ttl, settings.restart_grace)


def grace_arg(settings: LeaseSettings) -> int:
    """The grace argument of the scripts that grant: ms after Redis is found without the
    record, or :data:`OFF` when neither restart case is checked."""
    if not settings.restart_grace and not kept_grace(settings):
        return OFF
    return math.ceil(settings.restart_grace * 1000)


def _cluster_url(url: str) -> bool:
    """True if ``url`` names a Redis Cluster (a URL that does not parse: the drivers say why)."""
    try:
        return parse_target(url).kind == "cluster"
    except ValueError:
        return False


@dataclass(frozen=True)
class ResourceKeys:
    """The key names of one resource, and its slot group."""

    exclusive: str
    shared: str
    counter: str
    channel: str
    group: int
    waiters: str
    ticket_expiry: str
    handed: str
    history: str
    record: str
    revocation: str


class LeaseEngine:
    """The protocol's memory in this process (see the module docstring).

    Attributes:
        registered: owner -> monotonic time its home call (liveness refresh) was last sent.
        registry_until: (owner, group) -> monotonic time until which that registry surely
            exists.
        beat_won: beat claim key -> the last run this process counted as won.
        wait_replicas: the WAIT command sent after each grant and renewal ((): no
            min_replicas).
        cluster: True on a Redis Cluster (read from the URL: grants, renewals and cleanups
            go per node there).
    """

    def __init__(self, settings: LeaseSettings) -> None:
        self.settings = settings
        self.keys = Keyspace(settings.key_prefix, settings.slot_groups)
        self.url = settings.url
        self.registered: dict[str, float] = {}
        self.registry_until: dict[tuple[str, int], float] = {}
        self.beat_won: dict[str, int] = {}
        self.grace_ms = grace_arg(settings)
        self.liveness = str(self.ms(settings.ttl))
        #: the scripts' token counter memory (ms); 0: no counter is written (token_memory=0)
        self.token_memory_ms = self.ms(settings.token_memory) if settings.token_memory else 0
        self.wait_replicas: tuple[Any, ...] = ()
        if settings.min_replicas:
            self.wait_replicas = (
                "WAIT",
                settings.min_replicas,
                self.ms(settings.min_replicas_timeout),
            )
        #: the history arguments the scripts take last: entries kept per slot group, per
        #: resource, and how long (ms) a resource's history outlives its last event
        self.history = settings.history
        self.history_args: tuple[int, int, int] = (
            settings.history,
            min(settings.history, RESOURCE_HISTORY),
            self.ms(settings.history_keep),
        )
        #: the history arguments acquire.lua takes last: a resource's cap and the keep, then
        #: the group's cap; without history the "0" alone (each argument costs the server
        #: about 1,100 instructions: docs/benchmarks.md)
        hist, rhist, keep = self.history_args
        self.grant_history: tuple[int, ...] = (rhist, keep, hist) if hist else (0,)
        self.cluster = _cluster_url(settings.url)
        self.waiter_prefix = self.keys.waiter_channel_prefix
        # the settings are fixed: two of them read at every grant, kept as plain numbers
        self._ttl = settings.ttl
        self._margin = settings.margin_fraction
        self._rkeys: dict[str, ResourceKeys] = {}
        self._regkeys: dict[tuple[str, int], str] = {}
        self._homekeys: dict[str, tuple[str, str, str]] = {}
        self._lifekeys = [self.keys.lifetime(g) for g in range(settings.slot_groups)]

    def forked(self) -> None:
        """A new process: what the parent sent says nothing of this one's owner."""
        self.registered = {}

    # --- key names ------------------------------------------------------------------------
    def resource_keys(self, resource: str) -> ResourceKeys:
        """The key names of ``resource`` (cached: escaping is the costly part)."""
        keys = self._rkeys.get(resource)
        if keys is None:
            if len(self._rkeys) >= _KEY_CACHE_SIZE:
                self._rkeys.clear()
            x, s, n, c, q, qe, qh, h, rec, group = self.keys.per_resource(resource)
            rv = self.keys.revocation(resource)
            keys = self._rkeys[resource] = ResourceKeys(x, s, n, c, group, q, qe, qh, h, rec, rv)
        return keys

    def group_of(self, resource: str) -> int:
        """The slot group of ``resource`` (cached, as its key names)."""
        return self.resource_keys(resource).group

    def registry_key(self, owner: str, group: int) -> str:
        """The registry key of ``owner`` in slot group ``group`` (cached)."""
        key = self._regkeys.get((owner, group))
        if key is None:
            if len(self._regkeys) >= _KEY_CACHE_SIZE:
                self._regkeys.clear()
            key = self._regkeys[(owner, group)] = self.keys.registry(owner, group)
        return key

    def lifetime_key(self, group: int) -> str:
        """The lifetime record of slot group ``group`` (see :meth:`LeaseKeys.lifetime`)."""
        return self._lifekeys[group]

    def home_keys(self, node: str) -> tuple[str, str, str]:
        """The owners index, ``node``'s owner set and the node set: the home call's keys
        after the lifetime record and the registry (cached: escaping is the costly part)."""
        keys = self._homekeys.get(node)
        if keys is None:
            if len(self._homekeys) >= _KEY_CACHE_SIZE:
                self._homekeys.clear()
            k = self.keys
            keys = self._homekeys[node] = (k.owners, k.node(node), k.nodes)
        return keys

    # --- rules ----------------------------------------------------------------------------
    @staticmethod
    def ms(seconds: float) -> int:
        """Seconds as whole milliseconds, rounded up, at least 1."""
        return max(1, math.ceil(seconds * 1000))

    # The liveness is settings.ttl, whatever the leases' own TTLs: it is how soon the orphan
    # reconcile frees the leases of a dead owner. (It was max(ttl, settings.ttl): a lease of
    # ttl=3600 kept its dead owner "alive" for an hour, so reconcile could never free a lease
    # before the lease ran out by itself.) horizon() counts a lease lost within settings.ttl of
    # its last confirmation, so no live holder is reconciled away.

    def horizon(self, ttl: float) -> float:
        """Seconds after a confirmation that a lease of ``ttl`` counts as held.

        The owner's liveness runs out ``settings.ttl`` after its last renewal, and the orphan
        reconcile may then free its leases: so a lease counts as held for the shorter of the
        two, less the safety margin.
        """
        return min(ttl, self._ttl) * self._margin

    def liveness_covers(self, owner: str, ttl: float) -> bool:
        """True if ``owner``'s liveness surely outlasts a lease of ``ttl`` granted now.

        The one rule every path that grants follows (plain grants, unique takeovers, once,
        the beat leader and reconcile leases, sync and asyncio): a grant refreshes its owner's
        liveness to at least the grant's horizon, by the home call (group 0), unless this
        returns True. The home call registers the owner under its node and refreshes its
        liveness; skipping it is safe only while that liveness outlasts the new lease's
        horizon:

        - t0 the owner registers; t1 it idles past its liveness and a reconcile forgets it
          (off the node's owner set); t2 it takes a lease; t3 its node restarts and must
          find that lease.
        - t0 the owner's liveness is refreshed (it runs to t0 + settings.ttl); t1 it takes a
          lease it counts held until t1 + horizon, later than that; t2 a reconcile finds the
          liveness run out and frees the lease while its holder still counts it held.

        So with a lease ttl at least the ttl setting the liveness is always refreshed (in the
        same script call when the lease is in the home slot group).
        """
        registered = self.registered.get(owner)
        return registered is not None and (
            time.monotonic() + self.horizon(ttl) < registered + self._ttl * self._margin
        )

    def registry_expiry(self, owner: str, group: int, ttl: float, now: float) -> tuple[int, float]:
        """A grant's registry expiry argument (lua/_registry.lua), and the seconds it sets.

        A registry must outlive every lease it records (2 x the longest TTL), so a cleanup can
        always find them; it is set to 4 x TTL, and not touched again while at least 2 x TTL is
        left, which keeps the call off the hot path. Then the argument is that time left,
        negative: set only if the grant makes the registry anew (the release of the owner's
        last lease in the group emptied it, and Redis deleted it with its expiry), which
        makes the belief true again. Returns ``(argument in ms, seconds set or 0.0)``.
        """
        left = self.registry_until.get((owner, group), 0.0) - now
        if left >= 2 * ttl:
            return -self.ms(left), 0.0
        seconds = max(4 * ttl, left)
        return self.ms(seconds), seconds

    def check_replicated(self, acked: Any, what: str) -> None:
        """Raise ReplicaShortfall when WAIT's ``acked`` is below min_replicas."""
        want = self.settings.min_replicas
        if int(acked) < want:
            msg = (
                f"the {what} reached {acked} of the {want} replicas min_replicas asks for "
                f"within {self.settings.min_replicas_timeout}s"
            )
            raise ReplicaShortfall(msg)

    def replicated(
        self, name: str, keys: Sequence[str], args: Sequence[Any], what: str
    ) -> Steps[Any]:
        """The script ``name`` then ``WAIT`` (min_replicas) on its connection: its reply.
        ReplicaShortfall when too few replicas confirmed it (the write stands on the master)."""
        (reply,), (acked,) = yield SendReplicated([Script(name, keys, args)])
        self.check_replicated(acked, what)
        return reply

    # --- errors ---------------------------------------------------------------------------
    def backend_error(self, what: str, exc: BaseException) -> LeaseBackendError:
        """The LeaseBackendError for ``exc`` while trying to ``what`` (the URL without secrets)."""
        if isinstance(exc, Failure):
            exc = exc.cause
        msg = f"redis at {safe_url(self.url)} failed to {what}: {type(exc).__name__}: {exc}"
        return LeaseBackendError(msg)

    def send(
        self, what: str, calls: Sequence[Call], *, once: bool = False, transaction: bool = False
    ) -> Steps[list[Any]]:
        """One round trip of ``calls``; a failure raised as LeaseBackendError (to ``what``).

        ``once=False`` by default: the plain reads and idempotent writes this is for may be
        sent again by the client's own retry.
        """
        try:
            replies: list[Any] = yield Send(calls, once, transaction)
        except Failure as failure:
            raise self.backend_error(what, failure) from failure.cause
        return replies
