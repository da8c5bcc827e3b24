"""A worker whose leases Redis does not answer at start-up takes no task until it does.

The broker and result backend stay on the shared test Redis; only the leases Redis (a
private server, stopped) is unreachable. The worker must say so at WARNING, once per attempt,
not report "ready", and leave the queued leased task on the queue; once Redis answers it
starts and runs the task under its lease.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import pytest
from celery import Celery

from celery_leases import Leases

from .conftest import wait_until

pytestmark = pytest.mark.worker

NOT_ANSWERING = "the leases Redis does not answer at start-up"


def test_worker_waits_for_an_unreachable_leases_redis(
    start_worker: Any, make_redis_server: Any, worker_app: Any, send: Any, ledger: Any
) -> None:
    server = make_redis_server()
    server.stop()
    result = send(worker_app.guarded, "startup-down")
    worker = start_worker(
        "prefork",
        1,
        env={"CELERY_LEASES_REDIS_URL": server.url, "CELERY_LEASES_SOCKET_TIMEOUT": "0.5"},
        wait=False,
    )
    wait_until(
        lambda: worker.current_log().count(NOT_ANSWERING) >= 3, 30, "three start-up warnings"
    )
    log = worker.current_log()
    assert "ready." not in log
    assert " received" not in log
    assert "Traceback" not in log
    assert all("WARNING" in line for line in log.splitlines() if NOT_ANSWERING in line)
    assert result.state == "PENDING"
    assert ledger.runs() == 0

    server.start()
    worker.wait_ready()
    out = result.get(timeout=30)
    assert out["leases"][0][0] == "res:startup-down"
    assert ledger.runs() == 1


def test_a_worker_waiting_for_redis_stops_on_sigterm(
    start_worker: Any, make_redis_server: Any
) -> None:
    server = make_redis_server()
    server.stop()
    worker = start_worker("prefork", 1, env={"CELERY_LEASES_REDIS_URL": server.url}, wait=False)
    worker.wait_for_log(NOT_ANSWERING, 30)
    code = worker.stop(signal.SIGTERM, timeout=15)
    assert code is not None
    assert code >= 0, f"did not exit on SIGTERM by itself: {code}"
    assert "ready." not in worker.current_log()


def test_the_localhost_fallback_is_logged(caplog: pytest.LogCaptureFixture, monkeypatch: Any):
    """A non-Redis broker and no redis_url: the localhost default is said at start-up."""
    from celery_leases.worker import _note_redis_url

    monkeypatch.delenv("CELERY_LEASES_REDIS_URL", raising=False)
    app = Celery("fallback", broker="amqp://guest:secret@127.0.0.1:5672//", set_as_current=False)
    ext = Leases(app)
    with caplog.at_level(logging.WARNING, logger="celery_leases.worker"):
        _note_redis_url(ext)
    (record,) = [r for r in caplog.records if "no redis_url is set" in r.getMessage()]
    assert "redis://localhost:6379/0" in record.getMessage()
    assert "secret" not in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_leases.worker"):
        _note_redis_url(Leases(Celery("nobroker", set_as_current=False)))
    assert ["Celery's default, amqp" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    given = Leases(
        Celery("given", broker="amqp://127.0.0.1//", set_as_current=False),
        redis_url="redis://127.0.0.1:6390/1",
    )
    with caplog.at_level(logging.WARNING, logger="celery_leases.worker"):
        _note_redis_url(given)
    assert not caplog.records
