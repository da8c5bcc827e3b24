"""Shared test set-up: our own pytest plugin, and the integration marker by directory
(tests/integration and tests/faults need a real Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["celery_leases.pytest_plugin"]

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(_HERE).parts
        if parts and parts[0] in ("integration", "faults"):
            item.add_marker(pytest.mark.integration)


from tests.support.topologies import (  # noqa: E402  (fixtures)
    redis_cluster,
    redis_cluster_replicated,
    redis_sentinel,
    topology,
)

__all__ = ["redis_cluster", "redis_cluster_replicated", "redis_sentinel", "topology"]
