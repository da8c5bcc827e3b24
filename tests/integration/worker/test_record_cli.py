"""``show``, ``history``, ``health`` and ``top`` run for real, against a real worker.

The worker's task ``worker_app.sleeper`` holds ``res:<rid>`` while it sleeps; the worker and
the CLI both run with the history setting on.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_leases import LeaseBusy

from .conftest import kill_whole_worker, wait_until
from .test_cli import Cli, assert_one_line_error

pytestmark = pytest.mark.worker

#: live holders (nothing expires under the test), with the history on
LIVE = {
    "CELERY_LEASES_TTL": "60",
    "CELERY_LEASES_RECONCILE_INTERVAL": "0",
    "CELERY_LEASES_HISTORY": "1000",
}


@pytest.fixture
def cli(worker_env: dict[str, str]) -> Cli:
    return Cli({**worker_env, **LIVE})


def test_show_history_health_and_top_describe_a_workers_lease(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, cli: Cli, make_leases: Any
) -> None:
    w = start_worker("prefork", 2, env=LIVE)
    try:
        a = send(worker_app.sleeper, "rec", 120)
        ledger.wait_event("started:rec")
        before = make_leases(ttl=60).store.redis_time()
        contender = make_leases(ttl=60, history=1000)
        with pytest.raises(LeaseBusy), contender.hold("res:rec"):
            pass

        record = cli.json("show", "res:rec")
        (holder,) = record["holders"]
        assert holder["node"] == w.hostname
        assert holder["task_id"] == a.id
        assert holder["pid"] in w.children()
        assert holder["task_name"] == worker_app.sleeper.name
        assert holder["alive"] is True
        assert holder["mode"] == "exclusive"
        assert record["granted_at"] == holder["token"] / 1e6 <= before
        assert record["renewed_at"] is not None
        assert record["renewed_at"] >= record["granted_at"]
        assert record["transitions"] == 1
        assert record["waiters"] == 0
        kinds = [e["event"] for e in record["history"]]
        assert kinds == ["busy", "granted"]
        assert record["history"][1]["task_id"] == a.id
        assert record["history"][0]["node"] == contender.identity().node
        shown = cli("show", "res:rec")
        assert shown.returncode == 0, shown.stderr
        assert "transitions:  1" in shown.stdout
        assert "busy" in shown.stdout

        fleet = cli.json("history", "-n", "10")
        assert [e["event"] for e in fleet][:2] == ["busy", "granted"]
        mine = cli.json("history", "--node", w.hostname)
        assert [e["event"] for e in mine] == ["granted"]
        assert cli.json("history", "--resource", "res:other") == []
        table = cli("history", "--resource", "res:rec")
        assert table.returncode == 0, table.stderr
        assert table.stdout.splitlines()[0].split()[:3] == ["AT", "AGO", "EVENT"]

        ok = cli("health", "--node", w.hostname)
        assert ok.returncode == 0, ok.stderr
        assert f"node {w.hostname} is alive" in ok.stdout

        frame = cli("top", "--once")
        assert frame.returncode == 0, frame.stderr
        assert "res:rec" in frame.stdout
        assert "1 lease(s) held" in frame.stdout
        assert "busy/s" in frame.stdout
    finally:
        if w.alive():
            kill_whole_worker(w)


def test_an_idle_worker_is_healthy_by_its_mark(start_worker: Any, cli: Cli) -> None:
    # it holds nothing, so no process renews a liveness: the reaper's mark tells it lives
    w = start_worker("prefork", 1, env={**LIVE, "CELERY_LEASES_TTL": "3"})
    try:
        short = {"CELERY_LEASES_TTL": "3"}
        ok = wait_until(
            lambda: (r := cli("health", "--node", w.hostname, env=short)).returncode == 0 and r,
            timeout=30,
            what="the worker's first reaper pass marks it alive",
        )
        assert "(its worker, marked" in ok.stdout
        kill_whole_worker(w)
        line = wait_until(
            lambda: (
                (r := cli("health", "--node", w.hostname, env=short)).returncode == 2
                and assert_one_line_error(r, 2)
            ),
            timeout=30,
            what="the killed worker's mark runs out",
        )
        assert "is stale" in line
    finally:
        if w.alive():
            kill_whole_worker(w)


def test_health_without_a_node_and_with_a_stale_one(
    start_worker: Any, worker_env: dict[str, str], cli: Cli
) -> None:
    ok = cli("health")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: redis at ")
    unknown = cli("health", "--node", "nobody@nowhere")
    assert "no registered owner" in assert_one_line_error(unknown, 2)
    down = cli("health", env={"CELERY_LEASES_REDIS_URL": "redis://:hunter2@127.0.0.1:1/0"})
    line = assert_one_line_error(down, 1)
    assert "127.0.0.1:1" in line
    assert "hunter2" not in line


def test_a_stale_node_is_reported_with_its_age(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, cli: Cli
) -> None:
    doomed = {**LIVE, "CELERY_LEASES_TTL": "2"}
    w = start_worker("prefork", 1, env=doomed)
    send(worker_app.sleeper, "stale", 120)
    ledger.wait_event("started:stale")
    kill_whole_worker(w)
    short = {"CELERY_LEASES_TTL": "2"}

    def stale_line() -> str | None:
        result = cli("health", "--node", w.hostname, env=short)
        if result.returncode == 0:  # its worker's mark has not run out yet
            return None
        # first "late" (renewals missed, liveness running), then run out
        line = assert_one_line_error(result, 2)
        return line if "ran out" in line else None

    line = wait_until(stale_line, timeout=30, what="the killed node's liveness runs out")
    assert "liveness ran out" in line
    assert "ago" in line


def test_without_the_history_the_commands_say_so(cli: Cli, make_leases: Any) -> None:
    off = {"CELERY_LEASES_HISTORY": "0"}
    holder = make_leases(ttl=60)
    with holder.hold("quiet:1"):
        record = cli.json("show", "quiet:1", env=off)
        assert record["transitions"] is None
        assert record["renewed_at"] is None
        assert record["history"] == []
        assert record["granted_at"] == record["holders"][0]["token"] / 1e6
        shown = cli("show", "quiet:1", env=off)
        assert "transitions:  unknown (history off)" in shown.stdout
        frame = cli("top", "--once", env=off)
        assert frame.returncode == 0, frame.stderr
        assert "busy/s n/a (history off)" in frame.stdout
        assert "quiet:1" in frame.stdout
    assert cli.json("history", env=off) == []
    told = cli("history", env=off)
    assert told.returncode == 0, told.stderr
    assert "the history setting is 0" in told.stdout
