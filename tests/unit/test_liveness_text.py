"""The LIVENESS column: alive only while renewals come on time (score = last refresh + ttl)."""

from __future__ import annotations

import pytest

from celery_leases._census import Renewals, liveness_state, liveness_text, renewed_ago
from celery_leases.config import LeaseSettings

#: the defaults: ttl 30, renewed every 30 * 0.9 / 3 = 9 s at most, shown alive up to 10 s after
RENEWALS = Renewals.of(LeaseSettings(ttl=30.0, lost_margin=0.1))


def test_renewals_follow_the_heartbeat_interval() -> None:
    assert RENEWALS.ttl == 30.0
    assert RENEWALS.every == pytest.approx(9.0)


@pytest.mark.parametrize(
    ("left", "state", "text"),
    [
        (28.0, "alive", "alive (renewed 2.0 s ago)"),
        (21.0, "alive", "alive (renewed 9.0 s ago)"),  # on time, just
        (19.0, "late", "renewed 11 s ago, expires in 19 s"),  # killed 11 s ago
        (2.5, "late", "renewed 28 s ago, expires in 2.5 s"),
        (-3.0, "expired", "dead (expired 3.0 s ago)"),
        (None, "unregistered", "dead (not registered)"),
        (45.0, "alive", "alive (45 s left)"),  # an owner with a longer ttl setting
    ],
)
def test_liveness_text_follows_the_last_renewal(left: float | None, state: str, text: str) -> None:
    assert liveness_state(left, RENEWALS) == state
    assert liveness_text(left, RENEWALS) == text


def test_renewed_ago_is_the_ttl_less_what_is_left() -> None:
    assert renewed_ago(19.0, RENEWALS) == 11.0
    assert renewed_ago(30.0, RENEWALS) == 0.0
    assert renewed_ago(45.0, RENEWALS) is None
    assert renewed_ago(None, RENEWALS) is None
    assert renewed_ago(-5.0, RENEWALS) == 35.0
