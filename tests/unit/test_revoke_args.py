"""leases.revoke() refuses bad arguments before anything is sent (no Redis here)."""

from __future__ import annotations

import math

import pytest
from celery import Celery

from celery_leases import LeaseConfigError, LeaseLost, LeaseRevoked, Leases


@pytest.fixture
def leases() -> Leases:
    # nothing listens there: a call that got past the checks would fail with a backend error
    return Leases(Celery("t", set_as_current=False), redis_url="redis://127.0.0.1:1/0")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"deadline": 0}, "deadline must be a number of seconds > 0, not 0"),
        ({"deadline": -1.0}, "not -1.0"),
        ({"deadline": math.nan}, "not nan"),
        ({"deadline": math.inf}, "not inf"),
        ({"deadline": True}, "not True"),
        ({"deadline": "30"}, "not '30'"),
        ({"reason": 42}, "reason must be a str, not 42"),
        ({"reason": "x" * 501}, "reason is 501 characters long; at most 500 fit"),
    ],
)
def test_bad_arguments_are_named(leases: Leases, kwargs: dict, needle: str) -> None:
    with pytest.raises(LeaseConfigError, match="revoke: ") as info:
        leases.revoke("r", **kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("resource", ["", None, 7])
def test_a_resource_must_be_a_name(leases: Leases, resource: object) -> None:
    with pytest.raises(LeaseConfigError, match="revoke: resource must be"):
        leases.revoke(resource, deadline=5)  # type: ignore[arg-type]


def test_the_librarys_own_names_are_refused(leases: Leases) -> None:
    with pytest.raises(LeaseConfigError, match="inside celery_leases' own namespace"):
        leases.revoke("celery_leases:unique:report:42", deadline=5)


def test_lease_revoked_is_a_lease_lost_that_survives_json_results() -> None:
    exc = LeaseRevoked("r", 1.5, "operator", 20.0)
    assert isinstance(exc, LeaseLost)
    again = LeaseRevoked(*exc.args)
    assert (again.resource, again.held_for, again.reason, again.deadline) == (
        "r",
        1.5,
        "operator",
        20.0,
    )
    assert "revoked (operator)" in str(again)
