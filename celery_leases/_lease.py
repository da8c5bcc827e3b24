"""Lease (what a holder gets), Shared (what a caller asks for) and the per-lease state."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from ._keys import Keyspace
from .exceptions import LeaseConfigError, LeaseLost, LeaseRevoked

__all__ = (
    "MAX_NAME_BYTES",
    "RESERVED_PREFIX",
    "Lease",
    "LeaseArgumentError",
    "Shared",
    "check_name_size",
    "check_user_name",
    "held_of",
    "want_of",
)

Mode = Literal["x", "s"]

#: the most a resource name may take, in bytes of UTF-8 (docs/hold-and-once.md#resource-names):
#: a name is copied into each of a resource's keys (escaped, so up to three times as long)
#: and into registry entries, waiter orders and channel names; a longer text is an identity
#: to hash, not a name. The library's own prefix of a name it makes (``celery_leases:once:``
#: before a once name, ``celery_leases:unique:`` before a unique key) is not counted.
MAX_NAME_BYTES: Final = 1024
#: resource names the library takes for itself (once receipts, unique claims, beat, reconcile)
RESERVED_PREFIX: Final = "celery_leases:"


@dataclass(frozen=True)
class Shared:
    """Ask for a shared lease: compatible with other shared holders, never with an exclusive one.

    ``Shared(name, limit=N)`` admits at most ``N`` holders at once (a counting semaphore).
    In a task's ``leases=`` list, ``name`` is a template over the task's arguments.

    .. versionadded:: 0.1
    """

    name: str
    limit: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            msg = f"Shared() needs a non-empty resource name, got {self.name!r}"
            raise LeaseConfigError(msg)
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            msg = f"Shared({self.name!r}) limit must be a whole number >= 1, not {self.limit!r}"
            raise LeaseConfigError(msg)


@dataclass(frozen=True)
class Want:
    """One resource of an acquire request."""

    resource: str
    mode: Mode = "x"
    limit: int = 0

    def __post_init__(self) -> None:
        # Redis keys are bytes: a name that has no UTF-8 form (a lone surrogate, e.g. from a
        # badly decoded argument) would escape as a raw UnicodeEncodeError from redis-py
        if not isinstance(self.resource, str):
            return
        try:
            size = len(self.resource.encode("utf-8"))
        except UnicodeEncodeError as exc:
            msg = f"resource name {self.resource!r} cannot be encoded as UTF-8: {exc.reason}"
            raise LeaseConfigError(msg) from None
        # every lease, whatever made its name, passes here before anything is sent
        if size > MAX_NAME_BYTES:
            _check_size(_own_part(self.resource), "resource name")


def _own_part(resource: str) -> str:
    """``resource`` without the library's own prefix (``celery_leases:<kind>:``), if any."""
    if resource.startswith(RESERVED_PREFIX):
        _, sep, rest = resource[len(RESERVED_PREFIX) :].partition(":")
        if sep:
            return rest
    return resource


def check_name_size(name: str, what: str) -> None:
    """Refuse a name longer than :data:`MAX_NAME_BYTES` (in UTF-8), before anything is sent.

    Raises:
        LeaseConfigError: the name is too long; the message names ``what``, its size and the
            limit, and shows the name's start only.
    """
    if len(name) > MAX_NAME_BYTES // 4:  # shorter is within the limit whatever it holds
        _check_size(name, what)


def _check_size(name: str, what: str) -> None:
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        msg = (
            f"{what} is {size:,} bytes long in UTF-8 ({name[:40]!r}...); a resource name "
            f"may take at most {MAX_NAME_BYTES:,} bytes: hash a longer identity into a name"
        )
        raise LeaseConfigError(msg)


class LeaseArgumentError(LeaseConfigError, TypeError):
    """An argument of the wrong type: a TypeError, and a LeaseConfigError as it always was."""


def check_user_name(name: str, what: str) -> None:
    """Refuse a user's resource name inside the library's own namespace.

    Raises:
        LeaseConfigError: ``name`` starts with ``celery_leases:``.
    """
    if name.startswith(RESERVED_PREFIX):
        msg = (
            f"{what} {name!r} is inside celery_leases' own namespace ({RESERVED_PREFIX}...), "
            "which holds its once receipts, unique claims and beat and reconcile leases; "
            "choose another name"
        )
        raise LeaseConfigError(msg)


def want_of(item: str | Shared, what: str = "resource") -> Want:
    """Turn a user's ``"name"`` or ``Shared(...)`` into a :class:`Want`.

    Raises:
        LeaseArgumentError: (a TypeError and a LeaseConfigError) ``item`` is neither a str
            nor a Shared; the message names ``what``.
        LeaseConfigError: the name is empty, longer than :data:`MAX_NAME_BYTES`, or inside
            the library's own namespace.
    """
    if isinstance(item, Shared):
        check_name_size(item.name, what)
        want = Want(item.name, "s", item.limit or 0)
    elif isinstance(item, str):
        if not item:
            msg = f"{what} must be a non-empty name, got {item!r}"
            raise LeaseConfigError(msg)
        check_name_size(item, what)
        want = Want(item, "x", 0)
    else:
        msg = f"{what} must be a name (str) or a Shared(...), not {item!r} ({type(item).__name__})"
        raise LeaseArgumentError(msg)
    check_user_name(want.resource, what)
    return want


class Grantor(Protocol):
    """What a :class:`Held` needs of the engine that granted it: its key names.

    The protocol's engine (``_engine.LeaseEngine``) is one; a lease names no driver.
    """

    @property
    def keys(self) -> Keyspace:
        """The key names of the engine's prefix."""

    def group_of(self, resource: str) -> int:
        """The slot group of ``resource`` (cached by the engine)."""


@dataclass(eq=False)
class Held:
    """Mutable state of one granted lease, shared by its Lease and the heartbeat."""

    engine: Grantor
    owner: str
    resource: str
    mode: Mode
    token: int
    ttl: float
    acquired_at: float
    confirmed_at: float
    horizon: float  # seconds after a confirmation that the lease counts as held
    lost: bool = False
    released: bool = False
    task_id: str | None = None
    ticket: int = 0  # a lease handed to a waiter: its ticket, named by its registry entry
    call: str = ""  # the id of the grant call that made it, in its registry entry
    on_lost: list[Callable[[Held], None]] = field(default_factory=list)
    #: a revocation a renewal reported (leases.revoke): its reason (None: not revoked)
    revoked: str | None = None
    #: with ``revoked``: the monotonic time at which the lease counts as lost, before Redis
    #: lets it run out at the revocation's deadline
    cutoff: float = math.inf
    #: with ``revoked``: seconds left until the deadline when the holder learned of it
    revoke_left: float = 0.0
    #: with ``revoked``: the heartbeat told the holder (its on_lost callbacks ran)
    revoke_told: bool = False
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def deadline(self) -> float:
        """Monotonic time at which the lease counts as lost unless confirmed again."""
        return min(self.confirmed_at + self.horizon, self.cutoff)

    def revoke(self, reason: str, sent: float, left: float) -> None:
        """Record a revocation that a renewal sent at ``sent`` reported: ``left`` seconds to
        its deadline on the Redis clock. The lease counts as lost that much after ``sent``
        less the lost margin's share (``horizon / ttl``), before Redis lets it run out."""
        cutoff = sent + left * min(1.0, self.horizon / self.ttl)
        with self._guard:
            if self.revoked is None:
                self.revoke_left = left
            self.revoked = reason
            self.cutoff = min(self.cutoff, cutoff)

    def tell_revoked(self) -> bool:
        """True once, for the call that is to tell the holder of its revocation."""
        with self._guard:
            if self.revoked is None or self.revoke_told or self.lost or self.released:
                return False
            self.revoke_told = True
            return True

    def lost_error(self, now: float) -> LeaseLost:
        """The error that tells the holder the lease is lost, or revoked (:class:`LeaseRevoked`)."""
        if self.revoked is not None:
            return LeaseRevoked(
                self.resource,
                held_for=now - self.acquired_at,
                reason=self.revoked,
                deadline=self.revoke_left,
            )
        return LeaseLost(self.resource, held_for=now - self.acquired_at)

    @property
    def group(self) -> int:
        return self.engine.group_of(self.resource)

    def is_lost(self, now: float) -> bool:
        return self.lost or (not self.released and now >= self.deadline)

    def mark_released(self) -> bool:
        """Mark the lease released; True if this call did it (False: it already was)."""
        with self._guard:
            if self.released:
                return False
            self.released = True
            return True

    def mark_lost(self) -> bool:
        """Mark the lease lost; True if this call is the one that did it."""
        with self._guard:
            if self.lost or self.released:
                return False
            self.lost = True
            return True


@dataclass(frozen=True)
class Lease:
    """A granted lease, as the holder sees it.

    Attributes:
        resource: the rendered resource name.
        token: the fencing token of this grant. It is larger than every token granted for this
            resource before (shared grants included), so a store can refuse writes that carry
            an older token.
        ttl: seconds the lease lives without renewal.
        shared: True for a shared lease.

    .. versionadded:: 0.1
    """

    resource: str
    token: int
    ttl: float
    shared: bool
    _held: Held = field(repr=False, compare=False)

    @property
    def expires_in(self) -> float:
        """Seconds until the lease would run out without another renewal (0 once lost)."""
        held = self._held
        if held.released:
            return 0.0
        now = time.monotonic()
        if held.is_lost(now):
            return 0.0
        return max(0.0, min(held.confirmed_at + held.ttl, held.cutoff) - now)  # cutoff: revoked

    @property
    def lost(self) -> bool:
        """True once the lease is known or presumed lost."""
        return self._held.is_lost(time.monotonic())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease is no longer held, and
        :class:`LeaseRevoked` (a LeaseLost) once it was revoked (``leases.revoke``).

        It reads local state only (no Redis call): the heartbeat confirms the lease every
        ``ttl / 3``, and a lease not confirmed in time counts as lost before Redis could hand
        it to anyone else. A revocation is learnt at the renewal after it.
        """
        held = self._held
        now = time.monotonic()
        if held.revoked is not None or held.is_lost(now) or held.released:
            raise held.lost_error(now)


def held_of(lease: Lease) -> Held:
    """The mutable state behind ``lease`` (shared with the heartbeat and the store).

    ``Lease`` is public and frozen; its state stays a private field, read through here by
    the package's own modules (the app, once and unique claims).
    """
    return lease._held
