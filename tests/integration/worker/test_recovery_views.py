"""What operators see after a kill -9: honest liveness, recovery logs, the held gauge.

Real ``celery worker`` processes: a killed worker shows as "renewed N s ago" in ``owners`` and
``ls`` (never "alive") until its liveness runs out; the reaper's and the start-up cleanup's
log lines name the dead owner and the task whose lease they freed; the ``leases_held`` gauge
(prometheus multiprocess mode) drops a killed child's leases once the reaper freed them; and
``ls`` survives resource names that would break a table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from rich.cells import cell_len

from celery_leases._keys import escape
from tests.support.workers import leases_cli

from .conftest import APP, kill_whole_worker, wait_until

pytestmark = pytest.mark.worker

#: leases live 60 s: nothing but a cleanup frees them during a test
LONG = {"CELERY_LEASES_TTL": "60", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
#: a 24 s liveness (renewed every 8 s at most) and 60 s leases (worker_app.long_lease): after a kill
#: the owners are late for about 16 s, then expired, while their leases stay. The late window is
#: wide because each look runs two ``celery leases`` commands, a few seconds each on a busy machine
LIVENESS_TTL = 24
SLOW = {"CELERY_LEASES_TTL": str(LIVENESS_TTL), "CELERY_LEASES_RECONCILE_INTERVAL": "0"}


def run_leases(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A worker_app leases <args>``, as an operator runs it; it must succeed."""
    result = leases_cli(APP, env, *args)
    assert result.returncode == 0, result.stderr
    return result


def holder_of(test_leases: Any, resource: str) -> Any:
    (holder,) = wait_until(lambda: test_leases.store.holders(resource), 20, f"{resource} held")
    return holder


# --- liveness ---------------------------------------------------------------------------------
def test_an_idle_worker_shows_idle_never_dead(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, worker_env: dict[str, str]
) -> None:
    # a process renews its liveness only while it holds a lease: 6 s after its task, the
    # pool process's liveness has run out, while the worker marks its node alive every 2 s
    idle = {"CELERY_LEASES_TTL": "6", "CELERY_LEASES_RECONCILE_INTERVAL": "0"}
    env = {**worker_env, **idle}
    w = start_worker("prefork", 1, env=idle)
    send(worker_app.sleeper, "idle", 0)
    ledger.wait_event("started:idle")

    def ran_out() -> list[dict[str, Any]] | None:
        rows = [
            o
            for o in json.loads(run_leases(env, "owners", "--json").stdout)
            if o["node"] == w.hostname
        ]
        return rows if any(o["liveness"] < 0 for o in rows) else None

    rows = wait_until(ran_out, 60, "the idle owner's liveness to run out")
    assert all(o["leases"] == 0 for o in rows)
    assert "idle" in {o["status"] for o in rows}, rows
    assert not {o["status"] for o in rows} & {"late", "expired"}, rows
    lines = [line for line in run_leases(env, "owners").stdout.splitlines() if w.hostname in line]
    assert lines
    assert any("idle (holds nothing; its node is alive)" in line for line in lines), lines
    assert not [line for line in lines if "dead" in line or "renewed" in line], lines
    assert f"node {w.hostname} is alive" in run_leases(env, "health", "--node", w.hostname).stdout


def test_a_killed_worker_shows_renewed_n_s_ago_never_alive_until_it_expires(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, **SLOW}
    w = start_worker("prefork", 1, env=SLOW)
    send(worker_app.long_lease, "k", 300)
    ledger.wait_event("started:k")
    mine = escape(w.hostname) + "/"
    kill_whole_worker(w)

    def owner_row(state: str, status: str) -> tuple[dict[str, Any], str] | None:
        """``(json, table line)`` of the killed owner once its line says ``state`` and its
        json ``status`` (read just before), else None."""
        # both views read side by side, so that they describe the same moment
        with ThreadPoolExecutor(2) as pool:
            as_json = pool.submit(run_leases, env, "owners", "--json")
            as_table = pool.submit(run_leases, env, "owners")
            (listed,) = [
                o
                for o in json.loads(as_json.result().stdout)
                if o["owner"].startswith(mine) and o["leases"]
            ]
            table = as_table.result().stdout
        (line,) = [line for line in table.splitlines() if listed["owner"] in line]
        assert "alive" not in line or listed["liveness"] > LIVENESS_TTL / 3, line
        return (listed, line) if state in line and listed["status"] == status else None

    # its liveness has not run out: the old view said "alive (N s left)" all this time
    late, line = wait_until(
        lambda: owner_row(" s ago, expires in ", "late"), 30, "the killed owner to show late"
    )
    assert late["liveness"] > 0
    assert late["alive"] is True  # not run out yet: a reconcile or release leaves it alone
    assert late["renewed_ago"] > LIVENESS_TTL / 3
    assert " s ago, expires in " in line

    def ls_row() -> str | None:
        (row,) = [r for r in run_leases(env, "ls").stdout.splitlines() if r.startswith("res:k ")]
        return row if "renewed" in row or "dead" in row else None

    assert "alive" not in wait_until(ls_row, 30, "ls to show the killed owner as late")

    expired, line = wait_until(
        lambda: owner_row("dead (expired", "expired"), 60, "the owner to expire"
    )
    assert expired["alive"] is False


# --- recovery log lines -------------------------------------------------------------------------
def test_the_reaper_logs_the_dead_owner_and_the_task_of_each_freed_lease(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, test_leases: Any
) -> None:
    w = start_worker("prefork", 2, env=LONG)
    rid = "reaped\n[2026-01-01 00:00:00,000: INFO] forged"  # a newline must not forge a line
    resource = f"res:{rid}"
    try:
        task = send(worker_app.sleeper, rid, 300)
        ledger.wait_event(f"started:{rid}")
        holder = holder_of(test_leases, resource)
        os.kill(int(holder.owner.rsplit("/", 1)[1]), signal.SIGKILL)
        wait_until(lambda: not test_leases.store.holders(resource), 20, "the reaper to free it")
        shown = resource.replace("\n", "\\n")
        line = (
            f"reaper (dead pool process) freed 1 lease(s) of dead owner {holder.owner}, "
            f"task {task.id} ({worker_app.sleeper.name}): {shown}"
        )
        w.wait_for_log(line, 10)  # the whole line, the newline escaped
    finally:
        kill_whole_worker(w)


def test_the_start_up_cleanup_logs_the_dead_owner_and_the_task_it_freed(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, test_leases: Any
) -> None:
    w = start_worker("solo", 1, env=LONG)
    try:
        task = send(worker_app.sleeper, "restarted", 300)
        ledger.wait_event("started:restarted")
        holder = holder_of(test_leases, "res:restarted")
        kill_whole_worker(w)
        w.start()  # same name: the start-up cleanup frees the dead incarnation's lease
        line = (
            f"start-up cleanup of earlier incarnations of {w.hostname} freed 1 lease(s) of "
            f"dead owner {holder.owner}, task {task.id}: res:restarted"
        )
        w.wait_for_log(line, 10)
    finally:
        kill_whole_worker(w)


# --- the leases_held gauge ----------------------------------------------------------------------
def test_a_killed_childs_leases_leave_the_held_gauge_when_the_reaper_frees_them(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, test_leases: Any, tmp_path: Path
) -> None:
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {**LONG, "LEASES_TEST_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    w = start_worker("prefork", 2, env=env)

    def held() -> float:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(metrics_dir))
        value = registry.get_sample_value("celery_leases_leases_held", {"mode": "exclusive"})
        return value or 0.0

    try:
        send(worker_app.sleeper, "gauge", 300)
        ledger.wait_event("started:gauge")
        holder = holder_of(test_leases, "res:gauge")
        wait_until(lambda: held() == 1, 20, "the gauge to count the held lease")
        os.kill(int(holder.owner.rsplit("/", 1)[1]), signal.SIGKILL)
        wait_until(lambda: not test_leases.store.holders("res:gauge"), 20, "the reaper to free it")
        wait_until(lambda: held() == 0, 10, "the killed child's lease to leave the gauge")
    finally:
        kill_whole_worker(w)


# --- task names ----------------------------------------------------------------------------------
def test_ls_and_show_name_the_task_next_to_its_id_as_its_live_worker_tells(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, **LONG}
    w = start_worker("prefork", 1, env=LONG)
    try:
        task = send(worker_app.sleeper, "named", 300)
        ledger.wait_event("started:named")
        (listed,) = json.loads(run_leases(env, "ls", "--json").stdout)
        assert (listed["task_id"], listed["task_name"]) == (task.id, worker_app.sleeper.name)
        (row,) = [r for r in run_leases(env, "ls").stdout.splitlines() if r.startswith("res:")]
        assert row.endswith(f"{task.id}  {worker_app.sleeper.name}")
        (shown,) = json.loads(run_leases(env, "show", "res:named", "--json").stdout)["holders"]
        assert shown["task_name"] == worker_app.sleeper.name
        kill_whole_worker(w)
        # a dead worker names nothing: the id is all the registry has
        (listed,) = json.loads(run_leases(env, "ls", "--json").stdout)
        assert (listed["task_id"], listed["task_name"]) == (task.id, None)
    finally:
        if w.alive():
            kill_whole_worker(w)


# --- names that would break a table -------------------------------------------------------------
NAMES = ["nl\nname", "esc\x1b[31mred", "tab\tname", "nul\x00name", "日本語😀", "long:" + "x" * 200]


def test_ls_shows_any_resource_name_on_one_aligned_line_and_json_keeps_it_whole(
    worker_env: dict[str, str], test_leases: Any
) -> None:
    with test_leases.hold(NAMES, ttl=30):
        table = run_leases(worker_env, "ls").stdout
        listed = json.loads(run_leases(worker_env, "ls", "--json").stdout)
    assert sorted(x["resource"] for x in listed) == sorted(NAMES)
    header, *rows = table.rstrip("\n").split("\n")
    assert len(rows) == len(NAMES)
    assert all(row.isprintable() for row in rows)
    assert "\x1b" not in table
    # the MODE column starts at the same display column on every line
    start = cell_len(header[: header.index("MODE")])
    assert [cell_len(row[: row.index("exclusive")]) for row in rows] == [start] * len(rows)
    assert any("nl\\nname" in row for row in rows)
    assert any("esc\\x1b[31mred" in row for row in rows)
    assert any("long:xxx" in row and "…" in row for row in rows)
