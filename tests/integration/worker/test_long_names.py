"""A task whose lease template renders to a name too long fails with the error, holding nothing.

A declared template cannot know how long its names will be: each rendering is checked, in
the worker, before anything is sent to Redis (issue 26, part 5). The task is not lost and
not retried: it fails, its result says why, and the worker goes on with the next task.
"""

from __future__ import annotations

import redis

from celery_leases._lease import MAX_NAME_BYTES

from .conftest import wait_until

RESULT_TIMEOUT = 30.0


def test_a_rendered_name_too_long_fails_the_task_and_takes_no_lease(
    start_worker, worker_app, send, test_leases, ledger, leases_redis: redis.Redis, leases_prefix
):
    worker = start_worker("prefork", 1)
    rid = "x" * (2 * MAX_NAME_BYTES)
    result = send(worker_app.guarded, rid)
    result.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    error = result.result
    assert type(error).__name__ == "LeaseConfigError", repr(error)
    text = str(error)
    assert "lease template 'res:{rid}' renders to a name that is 2,052 bytes" in text
    assert f"at most {MAX_NAME_BYTES:,} bytes" in text
    assert ledger.runs() == 0  # the body never ran
    assert test_leases.store.holders("res:" + rid) == []
    keys = list(leases_redis.scan_iter(match=f"{{{leases_prefix}:*", count=1000))
    assert keys  # the worker registered its owner
    assert not [k for k in keys if "x" * 64 in k]  # no key of the name was made
    # the worker goes on: the next task, with a name that fits, runs
    fits = "y" * (MAX_NAME_BYTES - len("res:"))
    out = send(worker_app.guarded, fits).get(timeout=RESULT_TIMEOUT)
    assert out["leases"][0][0] == "res:" + fits
    wait_until(lambda: ledger.runs() == 1, RESULT_TIMEOUT, "the second task's run")
    assert worker.proc is not None
    assert worker.proc.poll() is None  # still running
