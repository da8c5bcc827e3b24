"""Issue 27's newcomer findings that need a real Redis: each said what it is."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_leases import LeaseBusy, LeasedTask, Leases, Shared, is_skipped
from celery_leases.cli import unleased_problem
from tests.support.polling import SCHEDULING


def test_a_nested_hold_says_it_is_the_same_owner(leases):
    with leases.hold("report:7"), pytest.raises(LeaseBusy) as info, leases.hold("report:7"):
        pass
    busy = info.value
    assert busy.same_owner is True
    assert "same owner" in str(busy)
    assert "not reentrant" in str(busy)
    assert "another owner" not in str(busy)
    # it survives a result backend's round trip as itself
    again = pickle.loads(pickle.dumps(busy))
    assert again.same_owner is True
    assert str(again) == str(busy)


def test_a_nested_ahold_says_it_is_the_same_owner(leases):
    async def main() -> LeaseBusy:
        async with leases.ahold("report:8"):
            with pytest.raises(LeaseBusy) as info:
                async with leases.ahold("report:8"):
                    pass
        return info.value

    busy = asyncio.run(main())
    assert busy.same_owner is True
    assert "not reentrant" in str(busy)


def test_an_exclusive_hold_inside_a_shared_one_is_the_same_owner(leases):
    with leases.hold(Shared("pool")), pytest.raises(LeaseBusy) as info, leases.hold("pool"):
        pass
    assert info.value.same_owner is True


def test_a_full_shared_limit_is_not_blamed_on_the_asking_owner(leases):
    # its own shared lease is one of the holders, not the one reason it is busy
    first = Shared("pool", limit=1)
    with leases.hold(first), pytest.raises(LeaseBusy) as info, leases.hold(first):
        pass
    assert info.value.same_owner is False
    assert "another owner" in str(info.value)


# --- item 6: a skipped task can be told from one that returned None ---------------------------
def _skipping_app(make_leases, **settings):
    app = Celery("skipper", set_as_current=False)
    app.conf.task_store_eager_result = False
    ext = make_leases(app, **settings)

    @app.task(shared=False, lease="report:{account_id}", on_busy="skip")
    def build_report(account_id):
        return None  # a body that returns None, as a skip did

    return ext, build_report


def test_a_skipped_task_returns_a_marker_is_skipped_tells(make_leases):
    ext, build_report = _skipping_app(make_leases)
    ran = build_report.apply((7,))
    assert ran.successful()
    assert ran.result is None
    assert not is_skipped(ran.result)
    assert not is_skipped(ran)
    with ext.hold("report:7"):
        skipped = build_report.apply((7,))
    assert skipped.successful()  # a skip is not an error
    assert is_skipped(skipped.result)
    assert is_skipped(skipped)
    assert skipped.result == {
        "celery_leases.skipped": {"resource": "report:7", "holder_task": None}
    }
    assert json.loads(json.dumps(skipped.result)) == skipped.result  # any result backend


def test_skip_result_none_keeps_the_old_none(make_leases):
    ext, build_report = _skipping_app(make_leases, skip_result="none")
    with ext.hold("report:8"):
        skipped = build_report.apply((8,))
    assert skipped.successful()
    assert skipped.result is None
    assert not is_skipped(skipped)


# --- item 1: lease options on an app without Leases(app) --------------------------------------
UNLEASED_APP = """
from celery import Celery

app = Celery("unleased", broker="memory://", backend="cache+memory://")


@app.task(lease="report:{account_id}", on_busy="skip")   # a celery-once migrant's first task
def build_report(account_id): ...


@app.task(unique="sync:{repo}")
def sync(repo): ...


@app.task
def plain(): ...
"""


def _worker(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "unleased_app.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "celery", "-A", "unleased_app", "worker", "--pool", "solo"]
    command += ["--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "INFO"]
    try:
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SCHEDULING
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"the worker started and ran (it should have refused):\n{out}")


def test_a_worker_refuses_lease_options_on_an_app_without_leases(tmp_path: Path) -> None:
    # the app's code never imports celery_leases: Celery's CLI loads the package's entry point
    assert "celery_leases" not in UNLEASED_APP
    done = _worker(tmp_path, UNLEASED_APP)
    assert done.returncode == 78, done.stderr  # EX_CONFIG
    assert "refusing to start" in done.stderr
    assert "unleased_app.build_report (lease, on_busy)" in done.stderr
    assert "unleased_app.sync (unique)" in done.stderr
    assert "unleased_app.plain" not in done.stderr
    assert "Leases(app)" in done.stderr


def test_unleased_problem_names_only_plain_tasks_of_apps_without_leases() -> None:
    app = Celery("mixed", set_as_current=False)

    @app.task(shared=False, lease="a:{x}")
    def plain_with_lease(x): ...

    @app.task(shared=False, base=LeasedTask, lease="b:{x}")
    def leased(x): ...  # LeasedTask makes Leases(app) itself, with a warning

    problem = unleased_problem(app)
    assert problem is not None
    assert "plain_with_lease (lease)" in problem
    assert ".leased" not in problem
    ext = Leases(app, redis_url="redis://127.0.0.1:1/0")  # never connects
    try:
        assert unleased_problem(app) is None
    finally:
        ext.store.close()
