"""Each Lua script's reply codes are named once, in _scripts, as its header comment states them."""

from __future__ import annotations

import re
from enum import IntEnum
from importlib.resources import files

import pytest

from celery_leases import _scripts

#: script -> the IntEnum of its reply codes (renew, expired_owners and leave reply with data only)
REPLIES: dict[str, type[IntEnum]] = {
    "acquire": _scripts.AcquireReply,
    "unique_claim": _scripts.UniqueClaimReply,
    "unique_handover": _scripts.UniqueHandoverReply,
    "release": _scripts.ReleaseReply,
    "beat_claim": _scripts.BeatClaimReply,
    "commit_receipt": _scripts.CommitReceiptReply,
    "forget_owner": _scripts.ForgetOwnerReply,
    "unique_requeue": _scripts.UniqueRequeueReply,
    "unique_unclaim": _scripts.UniqueUnclaimReply,
    "fenced_write": _scripts.FencedWriteReply,
    "lifetime_check": _scripts.LifetimeCheckReply,
    "limit": _scripts.LimitReply,
    "park": _scripts.ParkReply,
    "park_gate": _scripts.ParkGateReply,
    "park_limit": _scripts.ParkReply,
    "revoke": _scripts.RevokeReply,
}
DATA_ONLY = {
    "renew",
    "expired_owners",
    "leave",
    "limit_refund",
    "limit_penalize",
    "handon",
    "handon_limit",
    "unpark",
    "handon_takeover",
    "unreserve",
}


def _returns_comment(name: str) -> str:
    """The header comment of ``lua/<name>.lua`` from its ``returns`` line on."""
    text = (files("celery_leases") / "lua" / f"{name}.lua").read_text(encoding="utf-8")
    header = []
    for line in text.splitlines():
        if not line.startswith("--"):
            if header:
                break
            continue
        header.append(line)
    comment = "\n".join(header)
    assert "returns" in comment, f"{name}.lua's header does not say what it returns"
    return comment[comment.index("returns") :]


def test_every_script_is_accounted_for():
    assert sorted(REPLIES.keys() | DATA_ONLY) == sorted(_scripts.ALL)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_code_is_in_the_script_header(name: str):
    comment = _returns_comment(name)
    for member in REPLIES[name]:
        assert re.search(rf"(?<![\w-]){member.value}(?![\w])", comment), (
            f"{name}.lua's header does not mention {REPLIES[name].__name__}.{member.name}"
        )
    # every code the header gives as a reply's first element is named
    firsts = {int(m) for m in re.findall(r"\{(-?\d+),", comment)}
    assert firsts <= {m.value for m in REPLIES[name]}
