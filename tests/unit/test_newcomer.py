"""Issue 27's newcomer findings that need no Redis: nothing is silently ignored or misleading.

``Leases(app)`` connects lazily, so these only build and inspect settings.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_leases import Leases, _config_diagnostics
from celery_leases.config import resolve_settings
from celery_leases.exceptions import LeaseConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CELERY_LEASES_* variables from the outside world, and none warned about yet."""
    for name in list(os.environ):
        if name.upper().startswith("CELERY_LEASE"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(_config_diagnostics, "_warned_env", set(), raising=False)


def namespaced_app(obj: object) -> Celery:
    app = Celery("ns", set_as_current=False)
    app.config_from_object(obj, namespace="CELERY")
    return app


# --- item 2: typos that went unnoticed --------------------------------------------------------
def test_a_near_miss_of_the_namespace_is_refused_with_a_suggestion() -> None:
    class Singular:
        CELERY_LEASE_LOST_MARGIN = 0.2

    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(namespaced_app(Singular))
    text = str(info.value)
    assert "'CELERY_LEASE_LOST_MARGIN'" in text
    assert "did you mean CELERY_LEASES_LOST_MARGIN?" in text


def test_a_namespaced_key_in_a_config_without_namespace_is_refused() -> None:
    class NoNamespace:
        CELERY_LEASES_TTL = 12.0

    app = Celery("plain", set_as_current=False)
    app.config_from_object(NoNamespace)
    with pytest.raises(LeaseConfigError, match="did you mean leases_ttl"):
        resolve_settings(app)


def test_a_singular_celery_style_key_is_refused() -> None:
    app = Celery("plain", set_as_current=False)
    app.conf.lease_ttl = 5
    with pytest.raises(LeaseConfigError, match=r"'lease_ttl'.*did you mean leases_ttl"):
        resolve_settings(app)


def test_a_setting_of_the_project_that_merely_starts_with_lease_is_left_alone() -> None:
    class Project:
        LEASE_DURATION = 4  # the project's own, not a namespaced key
        CELERY_LEASES_TTL = 3.0

    assert resolve_settings(namespaced_app(Project)).ttl == 3.0


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("CELERY_LEASES_RETRY_MAX_DELAYS", "CELERY_LEASES_RETRY_MAX_DELAY"),
        ("CELERY_LEASES_TTLL", "CELERY_LEASES_TTL"),
    ],
)
def test_every_unknown_namespaced_key_has_a_suggestion(typo: str, meant: str) -> None:
    obj = type("Typo", (), {typo: 3})
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(namespaced_app(obj))
    assert f"did you mean {meant}?" in str(info.value)


def test_unknown_keyword_and_app_conf_settings_have_a_suggestion() -> None:
    with pytest.raises(LeaseConfigError, match=r"did you mean ttl=\?"):
        resolve_settings(None, tll=3)
    app = Celery("plain", set_as_current=False)
    app.conf.leases_key_prefx = "x"
    with pytest.raises(LeaseConfigError, match=r"did you mean leases_key_prefix\?"):
        resolve_settings(app)


def test_an_unknown_environment_variable_is_warned_once_with_a_suggestion(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CELERY_LEASES_TTLL", "5")
    monkeypatch.setenv("CELERY_LEASES_TEST_SOMETHING", "x")  # the suite's own: not a setting
    with caplog.at_level(logging.WARNING, logger="celery_leases.config"):
        app = Celery("env", set_as_current=False)
        leases = Leases(app)
        assert leases.settings.ttl == 30.0  # ignored, as the warning says
        resolve_settings(None)
    lines = [r.getMessage() for r in caplog.records if "CELERY_LEASES_" in r.getMessage()]
    assert lines == [
        "leases: environment variable CELERY_LEASES_TTLL is not a celery_leases setting "
        "and is ignored: did you mean CELERY_LEASES_TTL?"
    ]


# --- item 3: reading the settings is not a use ------------------------------------------------
def test_reading_settings_before_the_config_is_loaded_does_not_freeze_them() -> None:
    class Config:
        leases_ttl = 9.0

    app = Celery("late", set_as_current=False)
    leases = Leases(app)
    try:
        assert leases.settings.ttl == 30.0  # read before the config: not a use
        app.config_from_object(Config)
        assert leases.settings.ttl == 9.0  # still free to change
        assert leases.store.settings.ttl == 9.0  # the first use fixes them
        app.conf.leases_ttl = 3.0
        with pytest.raises(LeaseConfigError, match="changed after their first use"):
            leases._check_settings()  # what every acquire does
    finally:
        leases.store.close()


# --- item 8: one "(got ...)" ------------------------------------------------------------------
def test_a_bad_key_prefix_is_shown_once() -> None:
    with pytest.raises(LeaseConfigError) as info:
        Leases(Celery("p", set_as_current=False), key_prefix="my prefix!")
    assert str(info.value).count("(got 'my prefix!')") == 1


# --- the README's first command: scripts/demo -------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]

# the venv's python, replaced by a recorder: pip and the demo are logged, not run; `pick` (the
# Redis chooser) is the real one, told that every URL answers
STUB = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
case "$*" in
  *tests.support.servers\\ pick*)
    shift 2
    exec "$REAL_PYTHON" -c 'import sys; import tests.support.servers as s; \\
s.url_answers = lambda url: True; sys.exit(s.main(sys.argv[1:]))' "$@" ;;
  *example_project.demo*) echo "demo REDIS_URL=$REDIS_URL" >> "$STUB_LOG" ;;
esac
"""


def run_demo(tmp_path: Path, redis_url: str) -> list[str]:
    repo = tmp_path / "clone"
    (repo / "scripts").mkdir(parents=True)
    for name in ("demo", "_env.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    python = venv_bin / "python"
    python.write_text(STUB)
    python.chmod(0o755)
    log = tmp_path / "log"
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "STUB_LOG": str(log),
        "REAL_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "demo")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def test_the_demo_installs_only_what_it_needs(tmp_path: Path) -> None:
    lines = run_demo(tmp_path, "redis://127.0.0.1:6379")
    (install,) = [line for line in lines if "pip install" in line]
    # not '.[dev,docs]': gevent, eventlet, playwright, django, psycopg, mypy, mkdocs, ...
    assert install.endswith("-e .[demo]")


def test_the_demo_honours_the_database_in_redis_url(tmp_path: Path) -> None:
    assert "demo REDIS_URL=redis://127.0.0.1:6379/3" in run_demo(
        tmp_path / "a", "redis://127.0.0.1:6379/3"
    )
    # a URL without a database: 14, as before
    assert "demo REDIS_URL=redis://127.0.0.1:6379/14" in run_demo(
        tmp_path / "b", "redis://127.0.0.1:6379"
    )
