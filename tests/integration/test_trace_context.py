"""End to end: the trace of the request that enqueued a message continues at its consumer.

The publisher runs as ``outbox-publisher`` does (``build_publisher``), on the
global tracer provider. The global provider can be set only once per
process: the ``exporter`` fixture sets an SDK provider the first time and
adds its in-memory exporter to it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import outbox
from tests.support import ConsumedRecord, publish_until_idle, read_topic

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"
SECTION = "## Trace context (OpenTelemetry)"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Every span ended on the global tracer provider (an SDK one) while the module runs."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another global tracer provider was set first"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # later spans are dropped, not kept in memory


def _enqueue_in_a_request(database_url: str, topic: str) -> tuple[uuid.UUID, trace.SpanContext]:
    """Enqueue and commit one message within a request span; its id and the span's context."""
    with (
        trace.get_tracer("service").start_as_current_span("place order") as request,
        psycopg.connect(database_url) as conn,
    ):
        message_id = outbox.enqueue(conn, topic, {"order": 42}, key="customer-7")
    return message_id, request.get_span_context()


def _publish_and_read(database_url: str, kafka_bootstrap: str, topic: str) -> ConsumedRecord:
    assert publish_until_idle(database_url, kafka_bootstrap).delivered == 1
    (record,) = read_topic(kafka_bootstrap, topic)
    return record


def _producer_spans(exporter: InMemorySpanExporter, topic: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.PRODUCER
        and (s.attributes or {}).get("messaging.destination.name") == topic
    ]


def test_a_consumer_span_continues_the_enqueuing_trace_and_the_batch_span_links_to_it(
    database_url: str, kafka_bootstrap: str, topic: str, exporter: InMemorySpanExporter
) -> None:
    """The record's headers parent the consumer span on the enqueuing span; the publisher's
    batch span links to that span."""
    message_id, enqueued_in = _enqueue_in_a_request(database_url, topic)

    record = _publish_and_read(database_url, kafka_bootstrap, topic)

    assert record.outbox_id == message_id
    carrier = {name: value.decode() for name, value in record.headers}
    parent = TraceContextTextMapPropagator().extract(carrier)
    with trace.get_tracer("consumer").start_as_current_span(
        "process", context=parent, kind=SpanKind.CONSUMER
    ) as consumed:
        pass
    assert consumed.get_span_context().trace_id == enqueued_in.trace_id
    assert isinstance(consumed, ReadableSpan)
    assert consumed.parent is not None
    assert consumed.parent.span_id == enqueued_in.span_id

    (batch_span,) = _producer_spans(exporter, topic)
    assert batch_span.name == f"send {topic}"
    assert batch_span.status.status_code is StatusCode.UNSET
    assert [(link.context.trace_id, link.context.span_id) for link in batch_span.links] == [
        (enqueued_in.trace_id, enqueued_in.span_id)
    ]


def _doc_blocks() -> list[str]:
    """The ```python blocks of the doc's trace context section."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.M | re.S)


def test_the_consumer_example_of_the_embedding_doc_continues_the_trace(
    database_url: str, kafka_bootstrap: str, topic: str, exporter: InMemorySpanExporter
) -> None:
    """docs/embedding.md's ``handle`` bills a record inside a span of the enqueuing trace."""
    (code,) = _doc_blocks()
    _, enqueued_in = _enqueue_in_a_request(database_url, topic)
    record = _publish_and_read(database_url, kafka_bootstrap, topic)
    billed: list[trace.SpanContext] = []
    names: dict[str, Any] = {
        "bill": lambda value: billed.append(trace.get_current_span().get_span_context())
    }
    exec(compile(code, str(DOC), "exec"), names)  # noqa: S102 - the doc's own example

    # What kafka-python's ConsumerRecord has, as the example reads it.
    names["handle"](SimpleNamespace(topic=topic, headers=record.headers, value=record.value))

    (context,) = billed
    assert context.trace_id == enqueued_in.trace_id
    (consumed,) = [s for s in exporter.get_finished_spans() if s.name == f"process {topic}"]
    assert consumed.kind is SpanKind.CONSUMER
    assert consumed.parent is not None
    assert consumed.parent.span_id == enqueued_in.span_id
