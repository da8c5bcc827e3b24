"""Cooperative revocation, written once: revoke.lua's call and what its reply means. No I/O.

revoke.lua writes the resource's revocation mark, which renew.lua reads at each renewal.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final, NamedTuple

from ._keys import holder_parts
from ._lease import LeaseArgumentError, check_name_size, check_user_name
from ._protocol import Script, Steps
from ._scripts import RevokeReply
from .exceptions import LeaseConfigError

if TYPE_CHECKING:
    from ._engine import LeaseEngine

__all__ = ("MAX_REASON", "Revoked", "check_revoke", "revoke")

#: the longest reason a revocation may carry, in characters (it is stored in the mark)
MAX_REASON: Final = 500


class Revoked(NamedTuple):
    """What :meth:`Leases.revoke() <celery_leases.Leases.revoke>` did.

    Attributes:
        resource: the resource asked for.
        holders: the owner id of each holder asked to let go (empty: nobody held it, and
            nothing was done).
        tokens: the fencing token of each of those grants, in the same order.
        deadline: seconds from the call until Redis lets the grants run out (0.0: nobody
            held it); an earlier revocation of the same grants keeps its earlier deadline.
        reason: the reason given.

    .. versionadded:: 0.2
    """

    resource: str
    holders: tuple[str, ...]
    tokens: tuple[int, ...]
    deadline: float
    reason: str


def check_revoke(resource: object, reason: object, deadline: object) -> None:
    """Refuse a revocation's bad arguments before anything is sent.

    Raises:
        LeaseArgumentError: ``resource`` or ``reason`` is not a str.
        LeaseConfigError: an empty or too long name or reason, a name in the library's own
            namespace (``celery_leases:...``), or a deadline that is not a number of
            seconds > 0.
    """
    if not isinstance(resource, str):
        msg = f"revoke: resource must be a name (str), not {resource!r}"
        raise LeaseArgumentError(msg)
    if not resource:
        msg = "revoke: resource must be a non-empty name"
        raise LeaseConfigError(msg)
    check_name_size(resource, "revoke: resource")
    # once receipts, unique claims (a queued one has no holder to tell), beat and reconcile
    check_user_name(resource, "revoke: resource")
    if not isinstance(reason, str):
        msg = f"revoke: reason must be a str, not {reason!r}"
        raise LeaseArgumentError(msg)
    if len(reason) > MAX_REASON:
        msg = f"revoke: reason is {len(reason)} characters long; at most {MAX_REASON} fit"
        raise LeaseConfigError(msg)
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, (int, float))
        or not 0 < deadline < math.inf
    ):
        msg = f"revoke: deadline must be a number of seconds > 0, not {deadline!r}"
        raise LeaseConfigError(msg)


def revoke(engine: LeaseEngine, resource: str, reason: str, deadline: float) -> Steps[Revoked]:
    """Ask the holders of ``resource`` to let go within ``deadline`` seconds (revoke.lua).

    Idempotent, so a lost reply is sent again: a second run finds the mark and keeps its
    deadline.
    """
    rk = engine.resource_keys(resource)
    call = Script("revoke", [rk.exclusive, rk.shared, rk.revocation], [engine.ms(deadline), reason])
    (reply,) = yield from engine.send(f"revoke {resource!r}", [call])
    if int(reply[0]) == RevokeReply.NOT_HELD:
        return Revoked(resource, (), (), 0.0, reason)
    owners: list[str] = []
    tokens: list[int] = []
    for value in reply[2:]:
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        token, owner = holder_parts(text)
        owners.append(owner)
        tokens.append(int(token) if token.isdigit() else 0)
    return Revoked(resource, tuple(owners), tuple(tokens), int(reply[1]) / 1000, reason)
