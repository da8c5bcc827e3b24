"""Lease options on a plain ``@app.task`` (no ``base=LeasedTask``) work in a real worker.

People coming from celery-once write ``@app.task(lease=...)`` first; on an app with
``Leases(app)`` that task takes its leases like a LeasedTask instead of ignoring the option.
"""

from __future__ import annotations

from typing import Any

from celery_leases import is_skipped


def test_plain_task_takes_its_lease_in_a_worker(
    start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    start_worker("prefork", 1)
    result = send(worker_app.plain_guarded, "plain", 0.1).get(timeout=30)
    # the body saw the lease it was granted (current_leases), and it was given back after
    assert [name for name, _ in result["leases"]] == ["res:plain"]
    assert result["leases"][0][1] > 0
    assert test_leases.store.holders("res:plain") == []
    assert ledger.runs() == 1
    # one declared above Leases(app) in the app module is leased as well
    early = send(worker_app.plain_early, "early").get(timeout=30)
    assert [name for name, _ in early["leases"]] == ["res:early"]


def test_plain_task_on_busy_is_honoured_in_a_worker(
    start_worker: Any, worker_app: Any, send: Any, test_leases: Any, ledger: Any
) -> None:
    start_worker("solo", 1)
    with test_leases.hold("res:plain-busy", ttl=30):
        # on_busy="skip": the worker finds the lease held by this process and skips the body
        assert is_skipped(send(worker_app.plain_skip, "plain-busy").get(timeout=30))
    assert ledger.runs() == 0
    assert (
        send(worker_app.plain_skip, "plain-busy").get(timeout=30)["leases"][0][0]
        == "res:plain-busy"
    )
    assert ledger.runs() == 1
