"""Hold a lease on one of the library's own resources (celery_leases:...), as the library does.

``hold()`` refuses those names for user code; tests that contend with the library's own
leases (once, reconcile) take them through ``acquire``/``release``, the path the library uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from celery_leases import Lease, Leases
from celery_leases._lease import Want


@contextmanager
def hold_reserved(
    leases: Leases, resource: str, *, ttl: float | None = None, wait: float | None = 0.0
) -> Iterator[Lease]:
    """``leases.hold(resource)`` for a ``celery_leases:`` resource."""
    (lease,) = leases.acquire([Want(resource)], ttl=ttl, wait=wait)
    try:
        yield lease
    finally:
        leases.release([lease])
