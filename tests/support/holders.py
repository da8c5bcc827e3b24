"""A lease that another owner holds, for the tests of waiting."""

from __future__ import annotations

from celery_leases import Leases
from celery_leases._identity import Identity
from celery_leases._lease import Held, Want

#: the other owner
HOLDER = Identity("holder", "inc", 1)


def hold_by_hand(leases: Leases, resource: str, ttl: float = 30.0) -> list[Held]:
    """A lease of ``HOLDER`` on ``resource``, not renewed, released by the test."""
    held = leases.store.try_acquire([Want(resource)], HOLDER, ttl)
    assert isinstance(held, list)
    return held
