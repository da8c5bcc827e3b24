"""Node names: a process that is not a worker never gets a name a worker gets by default."""

from __future__ import annotations

import logging
import os
import socket

import pytest
from celery import Celery
from celery.utils.nodenames import default_nodename, host_format

from celery_leases import Leases, _identity
from celery_leases._identity import current_identity, default_node, set_process_kind
from celery_leases.beat import _name_beat_process

HOST = socket.gethostname()
PID = os.getpid()


@pytest.fixture(autouse=True)
def _no_process_naming(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process that nothing has named (and leaves it so)."""
    monkeypatch.setattr(_identity, "_node", None)
    monkeypatch.setattr(_identity, "_kind", None)
    monkeypatch.setattr(_identity, "_cache", {})  # identities are cached per process


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # the console script: program "celery", as Celery's default worker name starts
        (["/venv/bin/celery", "-A", "proj", "beat", "-l", "info"], "celery:beat"),
        (["/venv/bin/celery", "--app", "proj", "-b", "redis://x", "shell"], "celery:shell"),
        (["/venv/bin/celery", "--app=proj", "leases", "ls"], "celery:leases"),
        (["/venv/bin/celery", "-A", "proj", "worker", "-n", "w1@%h"], "celery:worker"),
        (["/venv/bin/celery"], "celery:proc"),
        # python -m celery
        (
            ["/venv/lib/python3.11/site-packages/celery/__main__.py", "-A", "p", "beat"],
            "celery:beat",
        ),
        (["/venv/bin/uvicorn", "proj.asgi:app"], "uvicorn:proc"),
        (["/venv/bin/gunicorn", "-w", "4", "proj.wsgi"], "gunicorn:proc"),
        (["/srv/proj/manage.py", "shell"], "manage.py:proc"),
        (["nightly-report.py"], "nightly-report.py:proc"),
        (["-c"], "python:proc"),
        ([], "python:proc"),
    ],
)
def test_default_node_names_program_kind_pid_and_host(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", argv)
    node = default_node()
    assert node == f"{expected}:{PID}@{HOST}"
    assert current_identity().node == node


def test_no_default_node_is_a_default_worker_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``celery beat`` was ``celery@<host>``: the name of a worker started without ``-n``."""
    worker_names = {
        default_nodename(None),  # celery worker
        default_nodename(HOST),  # celery worker -n <host>
        host_format(default_nodename("celery@%h")),  # celery worker -n celery@%h
        host_format(default_nodename("%h")),
        host_format(default_nodename("%n@%h")),
    }
    assert worker_names == {f"celery@{HOST}", f"{HOST.split('.')[0]}@{HOST}"}
    for argv in (["/venv/bin/celery", "-A", "proj", "beat"], ["/venv/bin/celery"], ["celery"]):
        monkeypatch.setattr("sys.argv", argv)
        assert default_node() not in worker_names
        set_process_kind("beat")
        assert default_node() not in worker_names
        monkeypatch.setattr(_identity, "_kind", None)


def test_two_processes_of_one_program_get_two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["/venv/bin/celery", "-A", "proj", "beat"])
    first = default_node()
    monkeypatch.setattr(os, "getpid", lambda: PID + 1)
    assert default_node() != first


def test_process_kind_and_worker_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["/srv/run_scheduler.py"])
    assert current_identity().node == f"run_scheduler.py:proc:{PID}@{HOST}"
    set_process_kind("beat")
    assert current_identity().node == f"run_scheduler.py:beat:{PID}@{HOST}"
    assert default_node("cli") == f"run_scheduler.py:cli:{PID}@{HOST}"
    # a worker names its node after its hostname, and its children inherit it
    _identity.set_node(f"celery@{HOST}")
    assert current_identity().node == f"celery@{HOST}"
    # the node setting wins over both
    assert current_identity("reports").node == "reports"


@pytest.mark.parametrize(("node", "warned"), [(f"celery@{HOST}", True), ("beat-prod", False)])
def test_beat_warns_of_a_node_setting_that_can_be_a_worker_name(
    node: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ext = Leases(Celery("naming", set_as_current=False), node=node)
    with caplog.at_level(logging.WARNING):
        _name_beat_process(ext)
    assert any("frees this beat's leases" in r.getMessage() for r in caplog.records) == warned
    assert ext.identity().node == node
