"""celery_leases: per-resource leases in Redis for Celery tasks.

A task says which resources it touches; before its body runs, the worker takes a lease on each
of them in Redis, all or nothing; a heartbeat keeps them alive while the body runs; a finalizer
gives them back however the task ends. A lease whose holder can no longer renew it runs out on
its own, and a restarted worker clears what its dead predecessor held at once.

    from celery import Celery
    from celery_leases import Leases

    app = Celery("proj", broker="redis://localhost:6379/0")
    leases = Leases(app)

    with leases.hold("report:42", ttl=30, wait=10) as lease:
        results.set("report:42", report, fence=lease)   # a FencedRedis: refuses older holders
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._lease import Lease, Shared
from ._limits import Rate
from ._revocation import Revoked
from .app import Leases
from .config import LeaseSettings
from .exceptions import (
    DuplicateTask,
    LeaseBackendError,
    LeaseBusy,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    LeaseRevoked,
    RateLimited,
    StaleFence,
)
from .fence import AsyncFencedRedis, FencedRedis
from .task import LeasedTask, current_claim, current_leases, is_skipped

try:
    __version__ = _version("celery-leases")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = (
    "AsyncFencedRedis",
    "current_claim",
    "current_leases",
    "DuplicateTask",
    "FencedRedis",
    "is_skipped",
    "Lease",
    "LeaseBackendError",
    "LeaseBusy",
    "LeaseConfigError",
    "LeasedTask",
    "LeaseError",
    "LeaseLost",
    "LeaseRevoked",
    "Leases",
    "LeaseSettings",
    "Rate",
    "RateLimited",
    "Revoked",
    "Shared",
    "StaleFence",
)
