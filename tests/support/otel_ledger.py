"""OpenTelemetry spans of a worker written to a Redis list, for a test to read back."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from celery_leases import otel


class LedgerExporter(SpanExporter):
    """Each span as JSON (name, attributes, status, times) appended to a Redis list."""

    def __init__(self, client: Callable[[], Any], key: str) -> None:
        self.client, self.key = client, key

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            record = {
                "name": span.name,
                "attributes": dict(span.attributes or {}),
                "status": span.status.status_code.name,
                "start": span.start_time,
                "end": span.end_time,
                "trace_id": span.context.trace_id if span.context else None,
            }
            self.client().rpush(self.key, json.dumps(record))
        return SpanExportResult.SUCCESS


def install_ledger_spans(client: Callable[[], Any], key: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(LedgerExporter(client, key)))
    otel.install(tracer_provider=provider)
