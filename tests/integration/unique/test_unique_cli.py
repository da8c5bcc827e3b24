"""``celery leases`` shows unique claims: queued ones (no process holds them) and running ones."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest
from celery import Celery

from celery_leases import Leases
from tests.support.workers import WorkerProc, leases_cli

from .conftest import APP, RESULT_TIMEOUT, Ledger, wait_until

pytestmark = pytest.mark.worker


def celery_leases(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return leases_cli(APP, env, *args)


def test_ls_show_stats_and_release_of_claims(
    producer: Celery,
    leases_of: Leases,
    ledger: Ledger,
    worker_env: dict[str, str],
    start_worker: Callable[..., WorkerProc],
):
    worker = start_worker(concurrency=1)
    running = producer.tasks["unique_app.gated"].delay("r")
    ledger.wait_started("r")
    wait_until(
        lambda: (h := leases_of.store.unique_holder("job:r")) is not None and h.state == "running",
        RESULT_TIMEOUT,
        "the claim of job:r to be taken over",
    )
    # the only pool process is busy: this one stays queued
    queued = producer.tasks["unique_app.quick"].delay("q")

    result = celery_leases(worker_env, "ls", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["resource"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {"celery_leases:unique:job:q", "celery_leases:unique:job:r"}
    q, r = rows["celery_leases:unique:job:q"], rows["celery_leases:unique:job:r"]
    assert (q["mode"], q["task_id"], q["owner"], q["node"], q["alive"]) == (
        "queued",
        queued.id,
        None,
        None,
        False,
    )
    assert 0 < q["expires_in"] <= 120
    assert (r["mode"], r["task_id"], r["node"], r["alive"]) == (
        "exclusive",
        running.id,
        worker.hostname,
        True,
    )

    text = celery_leases(worker_env, "ls")
    assert text.returncode == 0, text.stderr
    (line,) = [ln for ln in text.stdout.splitlines() if "job:q" in ln]
    assert "queued" in line
    assert queued.id in line
    # --owner: queued claims belong to no process
    mine = celery_leases(worker_env, "ls", "--json", "--owner", worker.hostname)
    assert [row["resource"] for row in json.loads(mine.stdout)] == ["celery_leases:unique:job:r"]

    show = celery_leases(worker_env, "show", "celery_leases:unique:job:q", "--json")
    assert show.returncode == 0, show.stderr
    (shown,) = json.loads(show.stdout)["holders"]
    assert (shown["mode"], shown["task_id"]) == ("queued", queued.id)

    stats = celery_leases(worker_env, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["queued_claims"] == 1

    # an operator frees a queued claim (its owner is no process: no --force needed)
    freed = celery_leases(worker_env, "release", "celery_leases:unique:job:q")
    assert freed.returncode == 0, freed.stderr
    assert f"queued claim of task {queued.id}" in freed.stdout
    assert leases_of.store.unique_holder("job:q") is None
    # a running claim's owner is alive: refused without --force
    refused = celery_leases(worker_env, "release", "celery_leases:unique:job:r")
    assert refused.returncode == 1
    assert "live owner" in refused.stderr
    ledger.open_gate("r")
    assert running.get(timeout=RESULT_TIMEOUT) == running.id
