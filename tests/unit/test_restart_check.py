"""The two restart graces the settings give (no server: see test_restarts.py for those)."""

from __future__ import annotations

import pytest

from celery_leases import _engine, _restart_check
from celery_leases._keys import Keyspace
from celery_leases.config import resolve_settings


@pytest.mark.parametrize(
    ("settings", "kept", "empty"),
    [
        ({}, 30.0, 0),  # the defaults: a restart that kept data waits the ttl, an empty one not
        ({"ttl": 5.0}, 5.0, 0),
        ({"restart_grace": 60.0}, 60.0, 60_000),  # the longer of the two
        ({"restart_grace": 2.0}, 30.0, 2_000),
        ({"restore_grace": 7.5}, 7.5, 0),
        ({"restore_grace": 0.0, "restart_grace": 4.0}, 0.0, 4_000),
        ({"restore_grace": 0.0}, 0.0, _engine.OFF),  # both off: the record is not even read
    ],
)
def test_graces(settings: dict[str, float], kept: float, empty: int) -> None:
    resolved = resolve_settings(None, **settings)
    assert _engine.kept_grace(resolved) == kept
    assert _engine.grace_arg(resolved) == empty


def test_no_connect_check_when_kept_data_is_not_checked() -> None:
    keys = Keyspace("p", 4)
    off = resolve_settings(None, restore_grace=0.0, restart_grace=3.0)
    assert _restart_check.connect_hook(keys, off, cluster=False) is None
    assert _restart_check.aconnect_hook(keys, off, cluster=True) is None
    on = resolve_settings(None)
    assert callable(_restart_check.connect_hook(keys, on, cluster=False))
    assert callable(_restart_check.aconnect_hook(keys, on, cluster=True))
