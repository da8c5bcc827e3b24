"""Leased tasks with the broker on RabbitMQ (leases and results stay in Redis).

The busy retry re-sends the task through the broker, so it must work on AMQP routing too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery import Celery

from .conftest import wait_until

pytestmark = pytest.mark.worker

RESULT_TIMEOUT = 30.0


@pytest.fixture
def amqp_client(amqp_url: str, leases_redis_url: str, queue: str) -> Iterator[Celery]:
    """A Celery app in this process that sends over RabbitMQ; the test queue is deleted after."""
    client = Celery("amqp-client", broker=amqp_url, backend=leases_redis_url, set_as_current=False)
    client.conf.task_default_queue = queue
    try:
        yield client
    finally:
        with client.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        client.close()


def test_leased_task_over_amqp_runs_retries_while_busy_and_releases(
    start_worker, worker_app, amqp_url, amqp_client, queue, test_leases, ledger
):
    worker = start_worker("prefork", 2, env={"LEASES_TEST_BROKER": amqp_url})
    assert "amqp://" in worker.log()

    out = amqp_client.send_task(worker_app.guarded.name, ["amqp", 0.1], queue=queue).get(
        timeout=RESULT_TIMEOUT
    )
    assert [r for r, _ in out["leases"]] == ["res:amqp"]
    assert test_leases.store.holders("res:amqp") == []

    with test_leases.hold("res:amqp-busy", ttl=20):
        result = amqp_client.send_task(worker_app.retry_no_budget.name, ["amqp-busy"], queue=queue)
        wait_until(lambda: result.state == "RETRY", RESULT_TIMEOUT, "state RETRY")
        wait_until(
            lambda: worker.log().count(f"[{result.id}] retry: retrying in") >= 2,
            RESULT_TIMEOUT,
            "two busy retries",
        )
        released_at = time.time()
    out = result.get(timeout=RESULT_TIMEOUT)
    assert out["started"] >= released_at
    assert out["retries"] == 0
    assert [r for r, _ in out["leases"]] == ["res:amqp-busy"]
    assert test_leases.store.holders("res:amqp-busy") == []
    assert ledger.overlaps() == 0
