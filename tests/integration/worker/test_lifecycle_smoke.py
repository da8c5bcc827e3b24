from __future__ import annotations


def test_guarded_task_runs_and_releases(start_worker, worker_app, send, test_leases, ledger):
    start_worker("solo", 1)
    result = send(worker_app.guarded, "a", 0.1).get(timeout=20)
    assert result["leases"][0][0] == "res:a"
    assert test_leases.store.holders("res:a") == []
    assert ledger.runs() == 1
