"""The Lua scripts of ``lua/``, read once from the package as constants, and their reply codes.

Each script's reply codes are named here once, one ``IntEnum`` per script, as its header
comment states them; the core operations (``_grants``, ``_claims``, ``_cleanup``), fence.py
and _restart_check.py compare replies with these (an ``IntEnum`` equals its int, so a reply from
Redis compares directly).
"""

from __future__ import annotations

from enum import IntEnum
from hashlib import sha1
from importlib.resources import files
from typing import Final

__all__ = (
    "ACQUIRE",
    "ALL",
    "BEAT_CLAIM",
    "COMMIT_RECEIPT",
    "EXPIRED_OWNERS",
    "FENCED_WRITE",
    "FORGET_OWNER",
    "LEAVE",
    "LIFETIME_CHECK",
    "LIMIT",
    "LIMIT_PENALIZE",
    "LIMIT_REFUND",
    "HANDON",
    "NOW",
    "PARK",
    "PARK_GATE",
    "PARK_LIMIT",
    "HANDON_LIMIT",
    "UNRESERVE",
    "SHA",
    "SOURCE",
    "RELEASE",
    "RENEW",
    "UNIQUE_CLAIM",
    "UNIQUE_HANDOVER",
    "UNIQUE_REQUEUE",
    "UNIQUE_UNCLAIM",
    "UNPARK",
    "AcquireReply",
    "BeatClaimReply",
    "CommitReceiptReply",
    "FencedWriteReply",
    "ForgetOwnerReply",
    "LifetimeCheckReply",
    "LimitReply",
    "ParkGateReply",
    "ParkReply",
    "ReleaseReply",
    "UniqueClaimReply",
    "UniqueHandoverReply",
    "UniqueRequeueReply",
    "UniqueUnclaimReply",
)


class AcquireReply(IntEnum):
    """acquire.lua's first reply element: ``{1, tokens...}``, ``{0, index, ms}``, ``{-1, ms}``."""

    GRACE = -1  #: restart grace: wait_ms follows
    BUSY = 0  #: the 1-based index of the first busy want and the ms until it may free follow
    GRANTED = 1  #: one token per want follows
    HANDED = 2  #: a release handed the lease to the call's ticket: its token follows


class UniqueClaimReply(IntEnum):
    """unique_claim.lua's first reply element."""

    BUSY = 0  #: held by another: the holder value and its pttl follow
    CLAIMED = 1  #: claimed for this task: the token follows
    CLAIMED_AGAIN = 2  #: already queued for this same task id (a re-publish): the token follows
    FOLLOWS = 4  #: keep_last: not sent; the task id of the run that takes its arguments follows
    THROTTLED = 3  #: a throttle window is running: the task id of its send and its pttl follow
    CANCELS = 5  #: cancel: not sent; the running holder, revoked, and ms to its deadline follow


class UniqueHandoverReply(IntEnum):
    """unique_handover.lua's first reply element."""

    REPLACED = -2  #: a later send replaced this task's claim: it never runs
    GRACE = -1  #: restart grace: wait_ms follows
    BUSY = 0  #: held by another: the holder value and its pttl follow
    TAKEN = 1  #: taken for this task: the token follows


class ReleaseReply(IntEnum):
    """release.lua's reply, one per lease."""

    NOT_HELD = 0  #: was no longer held by us
    RELEASED = 1  #: released now
    SPARED = 2  #: granted after a cleanup pass looked at the owner: kept (spare_from)


class ParkReply(IntEnum):
    """park.lua's first reply element."""

    FREE = 0  #: the resource has room and nobody is parked ahead: acquire again
    PARKED = 1  #: parked (the ms until the holder runs out follow)
    HANDED = 2  #: it was handed on already: consumed now, acquire again (the reservation)
    PARKED_ALREADY = 3  #: a copy of a task parked already: drop this delivery
    CONSUMED = 4  #: another copy consumed its hand-on: drop this delivery


class ParkGateReply(IntEnum):
    """park_gate.lua's reply."""

    NOT_PARKED = 0  #: go on
    HANDED = 1  #: the hand-on, consumed now: go on (the lease is reserved for the task)
    PARKED = 2  #: a copy of a parked task: drop this delivery
    CONSUMED = 3  #: consumed already: drop this delivery, unless it is a redelivered copy
    #: not parked, but others are parked on the resource: park behind them (4 + k: in the
    #: task's k-th FIFO of the group, see park_gate.lua)
    BEHIND = 4


class BeatClaimReply(IntEnum):
    """beat_claim.lua's first reply element (run id, Redis ms, winner and the Redis ms from
    which a refused run may be claimed follow)."""

    LOST = 0
    WON = 1
    EARLY = 2  #: an interval run less than half an interval after the last claimed one
    FUTURE = 3  #: a crontab run due further ahead of the Redis clock than the tolerance
    SKIPPED = 4  #: missed in an outage, outside the catch-up window: recorded, not sent
    MISSED = 5  #: a crontab run whose next run is due too: present the latest due run


class CommitReceiptReply(IntEnum):
    """commit_receipt.lua's reply."""

    NOT_OURS = 0  #: the lease is no longer ours: nothing stored
    STORED = 1


class ForgetOwnerReply(IntEnum):
    """forget_owner.lua's reply."""

    KEPT = 0  #: kept because it is alive
    FORGOTTEN = 1


class UniqueRequeueReply(IntEnum):
    """unique_requeue.lua's reply."""

    GONE = 0  #: that holder no longer has the claim: nothing changed
    QUEUED = 1  #: queued again for the task


class UniqueUnclaimReply(IntEnum):
    """unique_unclaim.lua's reply."""

    NOT_QUEUED = 0  #: not queued for that task: nothing changed
    RELEASED = 1


class FencedWriteReply(IntEnum):
    """fenced_write.lua's first reply element (the token, or the last accepted one, follows)."""

    REFUSED = 0  #: a newer token was accepted for this key
    APPLIED = 1


class LifetimeCheckReply(IntEnum):
    """lifetime_check.lua's second reply element (the first is the longest wait in ms)."""

    INFO_REFUSED = 0  #: INFO was refused (an ACL without +info)
    INFO_ANSWERED = 1


class LimitReply(IntEnum):
    """limit.lua's first reply element."""

    TOO_COSTLY = -1  #: the cost is above the N in force (an override): N and period follow
    REFUSED = 0  #: the wait in us, N, period and the Redis time follow (0 wait: a look only)
    ADMITTED = 1  #: the log member, N, period and the Redis time (us) follow


class RevokeReply(IntEnum):
    """revoke.lua's first reply element."""

    NOT_HELD = 0  #: nobody holds the resource: no mark was written
    REVOKED = 1  #: the ms left until the deadline and the holders follow


def _read(name: str) -> str:
    return (files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def _with_lifetime(name: str, *more: str) -> str:
    """The script ``name`` with the restart check of ``_lifetime.lua`` put in after its header
    comment: the check is written once (Redis scripts cannot share code otherwise)."""
    return _with(name, "_lifetime", *more)


def _with(name: str, *parts: str) -> str:
    """The script ``name`` with the shared code of ``parts`` (``_lifetime``, ``_waiters``,
    ``_tokens``, ``_registry``) put in after its header comment, in that order."""
    lines = _read(name).splitlines(keepends=True)
    code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("--"))
    shared = "".join(_read(part) for part in parts)
    return "".join(lines[:code]) + shared + "".join(lines[code:])


ACQUIRE: Final = _with_lifetime("acquire", "_waiters", "_tokens", "_registry")
RENEW: Final = _read("renew")
RELEASE: Final = _with_lifetime("release", "_waiters", "_tokens")
LEAVE: Final = _with("leave", "_waiters")
EXPIRED_OWNERS: Final = _read("expired_owners")
FORGET_OWNER: Final = _read("forget_owner")
COMMIT_RECEIPT: Final = _read("commit_receipt")
BEAT_CLAIM: Final = _read("beat_claim")
UNIQUE_CLAIM: Final = _with("unique_claim", "_tokens")
UNIQUE_HANDOVER: Final = _with_lifetime("unique_handover", "_tokens", "_registry", "_parking")
LIFETIME_CHECK: Final = _with_lifetime("lifetime_check")
UNIQUE_REQUEUE: Final = _read("unique_requeue")
UNIQUE_UNCLAIM: Final = _read("unique_unclaim")
FENCED_WRITE: Final = _read("fenced_write")
LIMIT: Final = _with("limit", "_limit")
LIMIT_REFUND: Final = _read("limit_refund")
LIMIT_PENALIZE: Final = _read("limit_penalize")
PARK: Final = _with("park", "_parking")
HANDON: Final = _with("handon", "_parking")
PARK_GATE: Final = _with("park_gate", "_parking")
UNPARK: Final = _with("unpark", "_parking")
PARK_LIMIT: Final = _with("park_limit", "_parking", "_limit")
HANDON_LIMIT: Final = _with("handon_limit", "_parking", "_limit")
REVOKE: Final = _read("revoke")
HANDON_TAKEOVER: Final = _read("handon_takeover")
UNRESERVE: Final = _read("unreserve")

ALL: Final[dict[str, str]] = {
    "acquire": ACQUIRE,
    "renew": RENEW,
    "release": RELEASE,
    "leave": LEAVE,
    "expired_owners": EXPIRED_OWNERS,
    "forget_owner": FORGET_OWNER,
    "commit_receipt": COMMIT_RECEIPT,
    "beat_claim": BEAT_CLAIM,
    "unique_claim": UNIQUE_CLAIM,
    "unique_handover": UNIQUE_HANDOVER,
    "unique_requeue": UNIQUE_REQUEUE,
    "unique_unclaim": UNIQUE_UNCLAIM,
    "fenced_write": FENCED_WRITE,
    "lifetime_check": LIFETIME_CHECK,
    "limit": LIMIT,
    "limit_refund": LIMIT_REFUND,
    "limit_penalize": LIMIT_PENALIZE,
    "park": PARK,
    "handon": HANDON,
    "park_gate": PARK_GATE,
    "unpark": UNPARK,
    "park_limit": PARK_LIMIT,
    "handon_limit": HANDON_LIMIT,
    "revoke": REVOKE,
    "handon_takeover": HANDON_TAKEOVER,
    "unreserve": UNRESERVE,
}

#: the Redis clock, read on the node serving KEYS[1] (a cluster pipeline cannot send TIME,
#: which names no key)
NOW: Final = "return redis.call('TIME')"

#: every script a driver may be asked to call (:class:`~celery_leases._protocol.Script`), by
#: name: the ones of ``lua/`` and the clock
SOURCE: Final[dict[str, str]] = {**ALL, "now": NOW}
#: their SHA1 digests, as EVALSHA names them
SHA: Final[dict[str, str]] = {name: sha1(src.encode()).hexdigest() for name, src in SOURCE.items()}
