"""The Lua scripts of ``lua/``, read once from the package as constants."""

from __future__ import annotations

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
    "LIFETIME_CHECK",
    "RELEASE",
    "RENEW",
    "UNIQUE_CLAIM",
    "UNIQUE_HANDOVER",
    "UNIQUE_REQUEUE",
    "UNIQUE_UNCLAIM",
)


def _read(name: str) -> str:
    return (files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def _with_lifetime(name: str) -> str:
    """The script ``name`` with the restart check of ``_lifetime.lua`` put in after its header
    comment: the check is written once (Redis scripts cannot share code otherwise)."""
    lines = _read(name).splitlines(keepends=True)
    code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("--"))
    return "".join(lines[:code]) + _read("_lifetime") + "".join(lines[code:])


ACQUIRE: Final = _with_lifetime("acquire")
RENEW: Final = _read("renew")
RELEASE: Final = _read("release")
EXPIRED_OWNERS: Final = _read("expired_owners")
FORGET_OWNER: Final = _read("forget_owner")
COMMIT_RECEIPT: Final = _read("commit_receipt")
BEAT_CLAIM: Final = _read("beat_claim")
UNIQUE_CLAIM: Final = _read("unique_claim")
UNIQUE_HANDOVER: Final = _with_lifetime("unique_handover")
LIFETIME_CHECK: Final = _with_lifetime("lifetime_check")
UNIQUE_REQUEUE: Final = _read("unique_requeue")
UNIQUE_UNCLAIM: Final = _read("unique_unclaim")
FENCED_WRITE: Final = _read("fenced_write")

ALL: Final[dict[str, str]] = {
    "acquire": ACQUIRE,
    "renew": RENEW,
    "release": RELEASE,
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
}
