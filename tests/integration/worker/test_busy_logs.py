"""What a busy lease writes to a real worker's log: one INFO line per busy retry, no
traceback for on_busy="fail", and the holder's task named in both."""

from __future__ import annotations

from typing import Any

import pytest

from celery_leases import LeaseBusy

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0


def lines_of(log: str, task_id: str) -> list[str]:
    return [line for line in log.splitlines() if f"[{task_id}]" in line]


def test_one_info_line_per_busy_retry_naming_the_holders_task(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any
) -> None:
    worker = start_worker("prefork", 2)
    holder = send(worker_app.sleeper, "busylog", 2.0)
    ledger.wait_event("started:busylog")
    waiter = send(worker_app.guarded, "busylog")
    out = waiter.get(timeout=RESULT_TIMEOUT)
    holder.get(timeout=RESULT_TIMEOUT)
    assert out["leases"][0][0] == "res:busylog"

    log = worker.log()
    ours = lines_of(log, waiter.id)
    retries = [line for line in ours if "retry: retrying in" in line]
    assert retries, "\n".join(ours)
    for line in retries:
        assert "'res:busylog'" in line
        assert f"held by task {holder.id}" in line
    # besides the retries: Celery's "received" of each re-published copy and the success
    others = [line for line in ours if line not in retries]
    assert all(" received" in line or " succeeded in " in line for line in others), others
    assert "is busy (retry after" not in log
    assert "Traceback" not in log


def test_busy_fail_is_an_expected_end_without_a_traceback(
    start_worker: Any, worker_app: Any, send: Any, ledger: Any
) -> None:
    worker = start_worker("prefork", 2)
    holder = send(worker_app.sleeper, "busyfail", 3.0)
    ledger.wait_event("started:busyfail")
    failed = send(worker_app.busy_fail, "busyfail")
    failed.get(timeout=RESULT_TIMEOUT, propagate=False)
    holder.get(timeout=RESULT_TIMEOUT)

    assert failed.state == "FAILURE"
    busy = failed.result
    assert isinstance(busy, LeaseBusy), repr(busy)
    assert busy.holder_task == holder.id
    log = worker.log()
    ours = lines_of(log, failed.id)
    assert [line for line in ours if "raised expected" in line], ours
    assert not [line for line in ours if "ERROR" in line], ours
    assert "Traceback" not in log
