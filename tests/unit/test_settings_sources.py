"""Settings are read where Celery users put them, when Celery would read them.

No Redis: ``Leases(app)`` connects lazily, so these only build and inspect settings.
"""

from __future__ import annotations

import os

import pytest
from celery import Celery

from celery_leases import Leases
from celery_leases.config import get_settings, resolve_settings
from celery_leases.exceptions import LeaseConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CELERY_LEASES_* variables from the outside world."""
    for name in list(os.environ):
        if name.upper().startswith("CELERY_LEASES_"):
            monkeypatch.delenv(name)


class DjangoStyle:
    """What ``django.conf:settings`` looks like to Celery: upper-case names on an object."""

    CELERY_BROKER_URL = "redis://127.0.0.1:6379/3"
    CELERY_LEASES_TTL = 12.0
    CELERY_LEASES_KEY_PREFIX = "proj-a"
    DEBUG = False


def namespaced_app(obj: object = DjangoStyle) -> Celery:
    app = Celery("ns", set_as_current=False)
    app.config_from_object(obj, namespace="CELERY")
    return app


# --- item 1: Celery's namespaced settings -----------------------------------------------------
def test_namespaced_keys_of_a_config_object_are_the_settings() -> None:
    settings = resolve_settings(namespaced_app())
    assert settings.ttl == 12.0
    assert settings.key_prefix == "proj-a"
    # Celery's own namespaced key is read by Celery too: the broker default follows it
    assert settings.redis_url == "redis://127.0.0.1:6379/3"


def test_leases_of_a_namespaced_app_uses_them() -> None:
    app = namespaced_app()
    leases = Leases(app)
    try:
        assert (leases.settings.ttl, leases.settings.key_prefix) == (12.0, "proj-a")
        assert leases.store.settings.key_prefix == "proj-a"
        assert get_settings(app) is leases.settings
    finally:
        leases.store.close()


def test_misspelt_namespaced_key_is_refused_like_a_misspelt_leases_key() -> None:
    class Typo:
        CELERY_LEASES_TTLL = 5

    with pytest.raises(LeaseConfigError, match="unknown setting 'ttll'") as info:
        resolve_settings(namespaced_app(Typo))
    assert "CELERY_LEASES_TTLL" in str(info.value)

    plain = Celery("plain", set_as_current=False)
    plain.conf.leases_ttll = 5
    with pytest.raises(LeaseConfigError, match="unknown setting 'ttll'"):
        resolve_settings(plain)


def test_namespaced_bad_value_names_the_key_it_came_from() -> None:
    class Bad:
        CELERY_LEASES_TTL = -1

    with pytest.raises(LeaseConfigError, match=r"'ttl' from CELERY_LEASES_TTL in the Celery"):
        resolve_settings(namespaced_app(Bad))


def test_precedence_app_conf_then_namespaced_object_then_plain_key_then_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CELERY_LEASES_TTL", "40")
    monkeypatch.setenv("CELERY_LEASES_ON_BUSY", "wait")
    monkeypatch.setenv("CELERY_LEASES_BUSY_TIMEOUT", "99")

    class Both:
        CELERY_LEASES_TTL = 12.0  # the namespaced spelling wins within the config object,
        leases_ttl = 13.0  # as Celery resolves its own keys
        leases_on_lost = "log"  # an un-namespaced key still counts
        CELERY_LEASES_BUSY_TIMEOUT = 5.0  # the config key wins over the same-named env var

    app = namespaced_app(Both)
    settings = resolve_settings(app)
    assert settings.ttl == 12.0
    assert settings.on_lost == "log"
    assert settings.busy_timeout == 5.0
    assert settings.on_busy == "wait"  # not in the config at all: the environment
    # app.conf.x = ... (Celery's "changes") comes before the config object
    app.conf.leases_ttl = 14.0
    assert resolve_settings(app).ttl == 14.0
    # the environment variable CELERY_LEASES_TTL is not the config key CELERY_LEASES_TTL
    monkeypatch.delenv("CELERY_LEASES_ON_BUSY")
    assert resolve_settings(app).on_busy == "retry"


def test_without_a_namespace_upper_case_keys_are_not_settings() -> None:
    """As for Celery's own keys: CELERY_LEASES_TTL in an un-namespaced config is not read,
    and so it is refused rather than silently ignored (issue 27)."""
    app = Celery("plain", set_as_current=False)
    app.config_from_object(DjangoStyle)
    with pytest.raises(LeaseConfigError, match=r"'CELERY_LEASES_TTL'.*no namespace"):
        resolve_settings(app)


# --- item 2: settings made after Leases(app) ---------------------------------------------------
def test_setting_made_after_leases_and_before_first_use_is_honoured() -> None:
    app = Celery("late", set_as_current=False)
    leases = Leases(app)
    app.conf.leases_ttl = 7.0
    app.conf.leases_key_prefix = "late-prefix"
    try:
        assert leases.settings.ttl == 7.0
        assert leases.store.settings.key_prefix == "late-prefix"
        assert get_settings(app).key_prefix == "late-prefix"
    finally:
        leases.store.close()


def test_config_from_object_after_leases_is_honoured() -> None:
    """The Django layout: Leases(app) in celery.py above app.config_from_object(...)."""
    app = Celery("late-obj", set_as_current=False)
    leases = Leases(app)
    app.config_from_object(DjangoStyle, namespace="CELERY")
    try:
        assert (leases.settings.ttl, leases.settings.key_prefix) == (12.0, "proj-a")
    finally:
        leases.store.close()


def test_invalid_late_setting_is_refused_at_first_use() -> None:
    app = Celery("late-bad", set_as_current=False)
    leases = Leases(app)
    app.conf.leases_ttl = -1
    with pytest.raises(LeaseConfigError, match=r"app\.conf\.leases_ttl"):
        _ = leases.settings


def test_setting_changed_after_first_use_is_refused_not_half_applied() -> None:
    app = Celery("changed", set_as_current=False)
    leases = Leases(app, redis_url="redis://127.0.0.1:1/0")
    first = leases._check_settings()  # first use (as every acquire): fixed from here on
    app.conf.leases_ttl = 9.0
    with pytest.raises(LeaseConfigError, match=r"changed after their first use.*leases_ttl"):
        leases._check_settings()
    # never half-applied: the settings and the store stay what they were
    assert leases.settings is first
    assert leases.store.settings.ttl == 30.0
    with pytest.raises(LeaseConfigError, match="leases_ttl"), leases.hold("x"):
        raise AssertionError("not reached")


class _NoEquality:
    """A config value whose ``==`` raises (as a numpy array's truth value does)."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("ambiguous")

    __hash__ = object.__hash__


def test_the_cheap_check_still_sees_a_leases_key_after_other_keys_changed() -> None:
    """The every-acquire check compares all of app.conf's writes at once; a write to another
    key (even one whose value cannot be compared) must not hide a later leases_* change."""
    app = Celery("cheap-check", set_as_current=False)
    leases = Leases(app, redis_url="redis://127.0.0.1:1/0")
    _ = leases.settings
    app.conf.worker_prefetch_multiplier = 3  # not ours: accepted
    leases._check_settings()
    app.conf.custom_value = _NoEquality()
    leases._check_settings()
    app.conf.custom_value = _NoEquality()  # another object: its == is asked, and raises
    leases._check_settings()
    app.conf.leases_lost_margin = 0.2
    with pytest.raises(LeaseConfigError, match=r"leases_lost_margin"):
        leases._check_settings()


def test_config_object_changed_after_first_use_is_refused_at_worker_start() -> None:
    """A change inside the config object itself is seen by the full check (worker, beat)."""

    class Mutable:
        CELERY_LEASES_TTL = 12.0

    app = namespaced_app(Mutable)
    leases = Leases(app)
    assert leases._check_settings().ttl == 12.0  # the first use
    Mutable.CELERY_LEASES_TTL = 15.0
    leases._check_settings()  # the cheap check looks at app.conf writes only
    with pytest.raises(LeaseConfigError, match=r"CELERY_LEASES_TTL \(12.0 -> 15.0\)"):
        leases._check_settings(full=True)


# --- item 5: a second Leases(app) ---------------------------------------------------------------
def test_second_leases_on_one_app_is_an_error() -> None:
    app = Celery("twice", set_as_current=False)
    first = Leases(app, key_prefix="first")
    with pytest.raises(LeaseConfigError, match="already has Leases"):
        Leases(app, key_prefix="second")
    assert app.leases is first  # type: ignore[attr-defined]
    assert get_settings(app).key_prefix == "first"


def test_environment_set_after_leases_and_before_first_use_is_honoured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = Celery("late-env", set_as_current=False)
    leases = Leases(app)
    monkeypatch.setenv("CELERY_LEASES_KEY_PREFIX", "from-env")
    try:
        assert leases.store.settings.key_prefix == "from-env"
    finally:
        leases.store.close()


def test_first_use_keeps_the_engine_when_nothing_changed() -> None:
    app = Celery("same", set_as_current=False)
    leases = Leases(app)
    made = leases._engine
    assert leases._store is None  # a driver is made at first use
    # first use: same settings, so the same engine (its caches) under the new store
    assert leases.store.engine is made
