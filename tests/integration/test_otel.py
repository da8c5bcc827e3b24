"""celery_leases.otel against a real Redis: each span is made when its event happens."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel test extra")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402

from celery_leases import LeaseBusy, otel  # noqa: E402
from celery_leases._cleanup import CleanupReport  # noqa: E402
from celery_leases._lease import Want  # noqa: E402
from celery_leases.worker import run_reconcile  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.install(tracer_provider=provider)
    yield exporter
    otel.uninstall()
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_install_is_idempotent_and_uninstall_stops_the_spans(spans, leases):
    assert otel.install() is otel.install()
    otel.uninstall()
    with leases.hold("quiet"):
        pass
    assert spans.get_finished_spans() == ()


def test_hold_makes_acquire_hold_and_release_spans(spans, leases):
    with leases.hold("report:42", ttl=10):
        pass
    (acquire,) = named(spans, "celery_leases.acquire")
    assert acquire.attributes["celery_leases.resource"] == "report:42"
    assert acquire.attributes["celery_leases.outcome"] == "granted"
    assert acquire.attributes["celery_leases.mode"] == "exclusive"
    assert acquire.attributes["celery_leases.ttl"] == 10
    assert acquire.attributes["celery_leases.wait_seconds"] >= 0
    assert "celery.task_id" not in acquire.attributes  # outside a task
    (hold,) = named(spans, "celery_leases.hold")
    assert hold.attributes["celery_leases.outcome"] == "released"
    assert hold.status.status_code is StatusCode.UNSET
    (release,) = named(spans, "celery_leases.release")
    assert release.attributes["celery_leases.resource"] == "report:42"
    # the hold ends once the release is done (both spans are made by that release)
    assert hold.start_time <= release.start_time <= release.end_time <= hold.end_time


def test_ahold_makes_the_same_spans(spans, leases):
    async def main() -> None:
        async with leases.ahold("async:1"):
            pass

    asyncio.run(main())
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["celery_leases.acquire", "celery_leases.hold", "celery_leases.release"]
    (release,) = named(spans, "celery_leases.release")
    assert release.end_time - release.start_time > 0  # the round trip of the release


def test_a_busy_acquire_records_its_wait(spans, leases):
    first = leases.acquire([Want("r")])
    try:
        with pytest.raises(LeaseBusy):
            leases.acquire([Want("r")], wait=0.3)
    finally:
        leases.release(first)
    busy = [
        s
        for s in named(spans, "celery_leases.acquire")
        if s.attributes["celery_leases.outcome"] == "busy"
    ]
    (span,) = busy
    assert span.attributes["celery_leases.resource"] == "r"
    # the attributes docs/tracing.md lists for every acquire span
    assert span.attributes["celery_leases.mode"] == "exclusive"
    assert span.attributes["celery_leases.ttl"] == leases.settings.ttl
    assert span.attributes["celery_leases.wait_seconds"] >= 0.3
    assert (span.end_time - span.start_time) / 1e9 >= 0.3


def test_renewal_rounds_are_spans(spans, leases):
    with leases.hold("r", ttl=0.3):
        wait_until(lambda: len(named(spans, "celery_leases.renew")) >= 2, 10, "two renewals")
    renew = named(spans, "celery_leases.renew")[0]
    assert renew.attributes["celery_leases.leases"] == 1
    assert renew.attributes["celery_leases.outcome"] == "ok"


def test_a_busy_shared_acquire_says_shared(spans, leases):
    first = leases.acquire([Want("pool", "x")], ttl=7)
    try:
        with pytest.raises(LeaseBusy):
            leases.acquire([Want("pool", "s")], ttl=9)
    finally:
        leases.release(first)
    (span,) = [
        s
        for s in named(spans, "celery_leases.acquire")
        if s.attributes["celery_leases.outcome"] == "busy"
    ]
    assert span.attributes["celery_leases.mode"] == "shared"
    assert span.attributes["celery_leases.ttl"] == 9


def test_a_cleanup_pass_that_did_something_is_a_span(spans, make_leases):
    ext = make_leases(node="otel-node")
    assert run_reconcile(ext) is not None
    # nothing to reconcile: a periodic pass that did nothing makes no span
    assert named(spans, "celery_leases.cleanup") == []
    observer = otel.install()  # the one the fixture installed
    observer.observe_cleanup("reaper", CleanupReport())
    assert named(spans, "celery_leases.cleanup") == []
    observer.observe_cleanup("reaper", CleanupReport(owners=["n:i:1"], released=[("n:i:1", "r")]))
    observer.observe_cleanup("startup", CleanupReport())  # once per worker: always told
    first, second = named(spans, "celery_leases.cleanup")
    assert first.attributes["celery_leases.kind"] == "reaper"
    assert first.attributes["celery_leases.released"] == 1
    assert second.attributes["celery_leases.kind"] == "startup"


def test_nothing_of_opentelemetry_is_imported_without_install():
    # redis-py imports opentelemetry itself when it is installed (redis.observability):
    # what celery_leases brings is what changes once the package is imported
    code = (
        "import sys\n"
        "import celery_leases\n"
        "from celery import Celery\n"
        "def loaded(): return {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "before = loaded()\n"
        "import celery_leases.otel\n"
        "celery_leases.Leases(Celery('x', set_as_current=False))\n"
        "print(sorted(loaded() - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_the_package_works_without_opentelemetry(leases_redis_url, leases_prefix):
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if not installed\n"
        "from celery import Celery\n"
        "from celery_leases import Leases, otel\n"
        f"ext = Leases(Celery('x', set_as_current=False), redis_url={leases_redis_url!r},\n"
        f"             key_prefix={leases_prefix!r})\n"
        "with ext.hold('r'):\n"
        "    pass\n"
        "try:\n"
        "    otel.install()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install celery-leases[otel]" in out.stdout


def test_install_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ImportError, match=r"pip install celery-leases\[otel\]"):
        otel.install()
