"""Settings: precedence kwargs > app.conf > env > defaults, and errors that say where."""

from __future__ import annotations

import os

import pytest
from celery import Celery
from pydantic import ValidationError

from celery_leases import Leases, LeaseSettings
from celery_leases.config import (
    DEFAULT_REDIS_URL,
    get_settings,
    resolve_settings,
    timing_warnings,
)
from celery_leases.exceptions import LeaseConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CELERY_LEASES_* or broker variables from the outside world."""
    for name in list(os.environ):
        if name.upper().startswith(("CELERY_LEASES_", "CELERY_BROKER")):
            monkeypatch.delenv(name)


def make_app(broker: str | None = None, **conf: object) -> Celery:
    app = Celery("conf-test", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults():
    s = resolve_settings(make_app())
    assert s.ttl == 30.0
    assert s.key_prefix == "leases"
    assert s.on_busy == "retry"
    assert s.on_lost == "interrupt"
    assert s.redis_url == DEFAULT_REDIS_URL


@pytest.mark.parametrize(
    ("field", "kw", "conf", "env", "default"),
    [
        ("ttl", 5.0, 10.0, "20", 30.0),
        ("key_prefix", "kw", "conf", "env", "leases"),
        ("on_busy", "fail", "skip", "wait", "retry"),
        ("on_lost", "log", "interrupt", "log", "interrupt"),
        ("slot_groups", 4, 8, "16", 1),
    ],
)
def test_precedence_kwargs_then_app_conf_then_env_then_default(
    monkeypatch, field, kw, conf, env, default
):
    app = make_app()
    assert getattr(resolve_settings(app), field) == default

    monkeypatch.setenv(f"CELERY_LEASES_{field.upper()}", env)
    from_env = getattr(resolve_settings(app), field)
    assert str(from_env) == env or from_env == type(default)(env)

    app.conf[f"leases_{field}"] = conf
    assert getattr(resolve_settings(app), field) == conf

    assert getattr(resolve_settings(app, **{field: kw}), field) == kw


def test_each_source_fills_its_own_fields(monkeypatch):
    monkeypatch.setenv("CELERY_LEASES_TTL", "12")
    monkeypatch.setenv("CELERY_LEASES_KEY_PREFIX", "from-env")
    app = make_app(leases_key_prefix="from-conf", leases_on_busy="skip")
    s = resolve_settings(app, on_busy="wait")
    assert (s.ttl, s.key_prefix, s.on_busy, s.on_lost) == (12.0, "from-conf", "wait", "interrupt")


def test_env_name_is_case_insensitive(monkeypatch):
    monkeypatch.setenv("celery_leases_ttl", "7")
    assert resolve_settings(make_app()).ttl == 7.0


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("kwargs", "keyword argument ttl="),
        ("conf", "app.conf.leases_ttl"),
        ("env", "environment variable CELERY_LEASES_TTL"),
    ],
)
def test_an_invalid_value_names_the_setting_and_its_source(monkeypatch, where, expected):
    app = make_app()
    kwargs = {}
    if where == "kwargs":
        kwargs["ttl"] = -1
    elif where == "conf":
        app.conf.leases_ttl = -1
    else:
        monkeypatch.setenv("CELERY_LEASES_TTL", "-1")
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(app, **kwargs)
    message = str(info.value)
    assert "'ttl'" in message
    assert expected in message


def test_the_source_named_is_the_one_that_won(monkeypatch):
    # env has a bad value too, but app.conf's value is the one in force
    monkeypatch.setenv("CELERY_LEASES_ON_BUSY", "explode")
    app = make_app(leases_on_busy="sometimes")
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(app)
    assert "app.conf.leases_on_busy" in str(info.value)
    assert "CELERY_LEASES_ON_BUSY" not in str(info.value)
    # kwargs override the bad ones entirely
    assert resolve_settings(app, on_busy="skip").on_busy == "skip"


def test_unparsable_env_value(monkeypatch):
    monkeypatch.setenv("CELERY_LEASES_TTL", "soon")
    with pytest.raises(LeaseConfigError, match=r"'ttl'.*CELERY_LEASES_TTL.*'soon'"):
        resolve_settings(make_app())


def test_unknown_app_conf_key_is_an_error():
    app = make_app(leases_tll=10)
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(app)
    assert "tll" in str(info.value)
    assert "app.conf.leases_tll" in str(info.value)


def test_unknown_keyword_is_an_error():
    with pytest.raises(LeaseConfigError, match=r"'tll'.*keyword argument"):
        resolve_settings(make_app(), tll=10)


def test_other_app_conf_keys_are_ignored():
    app = make_app(leasesx=1, task_default_queue="q", worker_concurrency=3)
    assert resolve_settings(app).ttl == 30.0


def test_config_error_is_a_value_error_not_a_validation_error():
    with pytest.raises(ValueError, match="'ttl'") as info:
        resolve_settings(make_app(), ttl="never")
    assert isinstance(info.value, LeaseConfigError)
    assert not isinstance(info.value, ValidationError)


def test_cross_field_rule_names_both_fields():
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(make_app(leases_retry_delay=10.0), retry_max_delay=2.0)
    message = str(info.value)
    assert "retry_max_delay" in message
    assert "retry_delay" in message
    assert "10" in message
    assert "2" in message


def test_cross_field_rule_accepts_equal_values():
    s = resolve_settings(make_app(), retry_delay=3.0, retry_max_delay=3.0)
    assert s.retry_delay == s.retry_max_delay == 3.0


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://broker-host:6380/3", "redis://broker-host:6380/3"),
        ("rediss://:pw@secure:6379/1", "rediss://:pw@secure:6379/1"),
        ("redis://a:6379/0;redis://b:6379/0", "redis://a:6379/0"),
        ("amqp://guest@rabbit//", DEFAULT_REDIS_URL),
        ("sqs://", DEFAULT_REDIS_URL),
        (None, DEFAULT_REDIS_URL),
    ],
)
def test_redis_url_defaults_to_a_redis_broker(broker, expected):
    s = resolve_settings(make_app(broker))
    assert s.redis_url == expected
    assert s.url == expected


def test_broker_default_for_redis_url_set_in_app_conf():
    app = make_app()
    app.conf.broker_url = "redis://conf-broker:6379/2"
    assert resolve_settings(app).redis_url == "redis://conf-broker:6379/2"


def test_an_explicit_redis_url_wins_over_the_broker(monkeypatch):
    app = make_app("redis://broker:6379/0")
    monkeypatch.setenv("CELERY_LEASES_REDIS_URL", "redis://env:6379/0")
    assert resolve_settings(app).redis_url == "redis://env:6379/0"
    app.conf.leases_redis_url = "redis://conf:6379/0"
    assert resolve_settings(app).redis_url == "redis://conf:6379/0"
    assert resolve_settings(app, redis_url="redis://kw:6379/0").redis_url == "redis://kw:6379/0"


def test_bad_redis_url_scheme():
    with pytest.raises(LeaseConfigError, match="redis_url"):
        resolve_settings(make_app(), redis_url="http://localhost:6379/0")


def test_config_error_never_shows_a_password():
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(make_app(), redis_url="http://user:hunter2@localhost:6379/0")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("prefix", ["", "a b", "{x}", "x" * 65, "a/b"])
def test_bad_key_prefix(prefix):
    with pytest.raises(LeaseConfigError, match="key_prefix"):
        resolve_settings(make_app(), key_prefix=prefix)


def test_settings_are_frozen():
    s = resolve_settings(make_app())
    with pytest.raises(ValidationError):
        s.ttl = 1.0  # type: ignore[misc]
    assert isinstance(s, LeaseSettings)


def test_leases_raises_config_error_and_get_settings_returns_its_settings():
    app = make_app(leases_ttl=9)
    with pytest.raises(LeaseConfigError, match="keyword argument"):
        Leases(app, ttl=0)
    leases = Leases(app, key_prefix="kw-prefix")
    try:
        assert get_settings(app) is leases.settings
        assert (leases.settings.ttl, leases.settings.key_prefix) == (9.0, "kw-prefix")
    finally:
        leases.store.close()


def test_a_renewal_that_cannot_wait_for_its_replicas_is_refused_with_the_numbers():
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(None, ttl=2.0, lost_margin=0.25, min_replicas=1, min_replicas_timeout=1.0)
    text = str(info.value)
    assert "ttl 2 s with lost_margin 0.25 leaves 1.5 s" in text
    assert "renewed every 0.5 s, a renewal has 1 s" in text
    assert "min_replicas_timeout (1 s) must be below 1 s" in text
    # the same timeout without min_replicas waits for nothing: accepted
    assert resolve_settings(None, ttl=2.0, lost_margin=0.25, min_replicas_timeout=1.0)
    assert resolve_settings(None, ttl=2.0, min_replicas=1, min_replicas_timeout=0.5)


def test_risky_timings_are_warnings_with_the_numbers():
    assert timing_warnings(resolve_settings(None)) == []
    (hangs,) = timing_warnings(resolve_settings(None, ttl=2.0, lost_margin=0.4, socket_timeout=0.5))
    assert "ttl 2 s with lost_margin 0.4 leaves 1.2 s" in hangs
    assert "socket_timeout < 0.4 s (or a ttl of 2.5 s or more)" in hangs
    # what the warning proposes is quiet
    assert (
        timing_warnings(resolve_settings(None, ttl=2.6, lost_margin=0.4, socket_timeout=0.5)) == []
    )
    assert (
        timing_warnings(resolve_settings(None, ttl=2.0, lost_margin=0.4, socket_timeout=0.39)) == []
    )
    (grace,) = timing_warnings(resolve_settings(None, restart_grace=3.0))
    assert grace.startswith("restart_grace (3 s) is below the ttl (30 s)")
    assert timing_warnings(resolve_settings(None, restart_grace=30.0, restore_grace=0.0)) == []
