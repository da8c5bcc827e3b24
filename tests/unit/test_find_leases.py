"""app.find_leases: the one way to find an app's Leases."""

from __future__ import annotations

from celery import Celery

from celery_leases import Leases
from celery_leases.app import find_leases


def test_an_app_without_leases_has_none():
    app = Celery("no_leases", set_as_current=False)
    assert find_leases(app) is None
    assert find_leases(None) is None
    app.leases = "something else"  # type: ignore[attr-defined]
    assert find_leases(app) is None


def test_the_leases_of_an_app_are_found():
    app = Celery("with_leases", set_as_current=False)
    ext = Leases.__new__(Leases)  # no Redis client: only the lookup is under test
    app.leases = ext  # type: ignore[attr-defined]
    assert find_leases(app) is ext
