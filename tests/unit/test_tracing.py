"""Trace context: the headers enqueue adds (outbox.tracing) and the publisher's batch spans
(publisher.tracing), with the OpenTelemetry SDK's in-memory exporter.

Each test builds a tracer provider of its own and passes it explicitly: the
global one can be set only once per process. Spans are made current with
``start_as_current_span``, which needs no global provider.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import errors as kafka_errors
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState

from outbox.intent import build_intent
from outbox.states import State
from outbox.tracing import MAX_TRACESTATE, bounded_tracestate
from publisher.outcomes import TransactionEnd
from publisher.sink import SendReport
from publisher.store import Batch, ClaimedMessage
from publisher.tracing import MAX_LINKS, batch_spans
from tests.unit.test_loop import TRANSACTIONAL, FakeSink, FakeStore, _batch, _message, _publisher

ROOT = Path(__file__).resolve().parents[2]
PROPAGATOR = TraceContextTextMapPropagator()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """Where the spans of ``provider`` go."""
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A tracer provider of this test's own, exporting each span as it ends."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def _headers(names: list[str], values: list[bytes]) -> dict[str, bytes]:
    assert len(names) == len(set(names)), names
    return dict(zip(names, values, strict=True))


def _traceparent(context: SpanContext) -> bytes:
    """The W3C traceparent of ``context``, as the propagator writes it."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, trace.set_span_in_context(NonRecordingSpan(context)))
    return carrier["traceparent"].encode()


def _remote(trace_id: int, span_id: int, state: TraceState | None = None) -> SpanContext:
    return SpanContext(trace_id, span_id, True, TraceFlags(TraceFlags.SAMPLED), state)


# --- enqueue: the headers build_intent adds ----------------------------------------


def test_a_current_span_adds_its_traceparent_after_the_callers_headers(
    provider: TracerProvider,
) -> None:
    """Within a span, the intent carries that span's traceparent; no tracestate when empty."""
    with provider.get_tracer("test").start_as_current_span("request") as span:
        intent = build_intent("orders", {"id": 1}, headers={"tenant": "acme"})

    assert intent.header_names == ["tenant", "traceparent", "content-type"]
    assert _headers(intent.header_names, intent.header_values)["traceparent"] == _traceparent(
        span.get_span_context()
    )


def test_a_non_empty_tracestate_is_stored_beside_the_traceparent(provider: TracerProvider) -> None:
    """A span whose trace has vendor state (inherited from its remote parent) stores it too."""
    parent = _remote(0xABC, 0xDEF, TraceState([("vendor", "v1"), ("other", "x")]))
    with provider.get_tracer("test").start_as_current_span(
        "request", context=trace.set_span_in_context(NonRecordingSpan(parent))
    ):
        intent = build_intent("orders", b"raw")

    headers = _headers(intent.header_names, intent.header_values)
    assert headers["traceparent"].startswith(b"00-00000000000000000000000000000abc-")
    assert headers["tracestate"] == b"vendor=v1,other=x"


def test_a_long_tracestate_is_cut_as_w3c_trace_context_allows(provider: TracerProvider) -> None:
    """A tracestate built in the process can hold 32 members of up to 512 characters, past
    Kafka's default message size with the largest message the limits accept: long members
    go first, then members from the end, to at most 512 characters."""
    members = [(f"v{i}", "x" * 200 if i % 2 else f"s{i}" * 20) for i in range(32)]
    parent = _remote(0xABC, 0xDEF, TraceState(members))
    with provider.get_tracer("test").start_as_current_span(
        "request", context=trace.set_span_in_context(NonRecordingSpan(parent))
    ):
        intent = build_intent("orders", b"raw")
    stored = _headers(intent.header_names, intent.header_values)["tracestate"].decode()
    assert len(stored) <= MAX_TRACESTATE
    short = [f"{key}={value}" for key, value in members if len(value) < 128]
    kept = stored.split(",")
    assert kept == short[: len(kept)]  # the long ones gone, then the short ones from the end
    assert len(",".join(short[: len(kept) + 1])) > MAX_TRACESTATE  # as many as fit


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("a=1,b=2", "a=1,b=2"),
        (",".join(["k=" + "v" * 300, "a=1"]), "k=" + "v" * 300 + ",a=1"),  # 306 <= 512
        (",".join(["k=" + "v" * 300, "j=" + "w" * 300, "a=1"]), "a=1"),
        ("k=" + "v" * 600, ""),  # nothing left: the header is left out
    ],
    ids=["short", "fits", "long-members-first", "none-left"],
)
def test_bounded_tracestate(value: str, stored: str) -> None:
    assert bounded_tracestate(value) == stored


@pytest.mark.parametrize("name", ["traceparent", "TraceParent", "tracestate"])
def test_a_trace_header_the_caller_set_is_kept_and_nothing_is_added(
    provider: TracerProvider, name: str
) -> None:
    """The caller's trace context wins whole, whatever the case of its header name."""
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with provider.get_tracer("test").start_as_current_span("request"):
        intent = build_intent("orders", b"raw", headers=[(name, own)])

    assert intent.header_names == [name]
    assert intent.header_values == [own.encode()]


def test_without_a_current_span_no_trace_header_is_added() -> None:
    """No span current (OpenTelemetry installed): the headers are the caller's alone."""
    assert not trace.get_current_span().get_span_context().is_valid

    intent = build_intent("orders", b"raw", headers={"tenant": "acme"})

    assert intent.header_names == ["tenant"]


def test_an_invalid_current_span_context_adds_nothing() -> None:
    """A current span whose context is not valid (all-zero ids) has no trace to continue."""
    with trace.use_span(NonRecordingSpan(_remote(0, 0))):
        intent = build_intent("orders", b"raw")

    assert intent.header_names == []


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter on this checkout; return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


#: Makes every import of ``opentelemetry`` fail, as if it were not installed, and records
#: each attempt.
_BLOCK_OPENTELEMETRY = """
    import sys

    attempts = []

    class NoOpenTelemetry:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                attempts.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoOpenTelemetry())

    def imported():
        return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
"""


def test_without_opentelemetry_enqueue_adds_nothing_and_tries_the_import_once() -> None:
    """OpenTelemetry not installed: intents are unchanged, and its import is tried only once."""
    out = _run_python(
        _BLOCK_OPENTELEMETRY
        + """
    from outbox.intent import build_intent

    first = build_intent("orders", {"id": 1}, headers={"tenant": "acme"})
    second = build_intent("orders", b"raw")
    print(first.header_names, second.header_names, attempts, imported())
    """
    )
    assert out.split("\n")[0] == "['tenant', 'content-type'] [] ['opentelemetry'] []"


def test_importing_the_library_imports_nothing_of_opentelemetry() -> None:
    """Installed, OpenTelemetry is imported on the first enqueue, not with ``outbox``."""
    out = _run_python(
        """
    import sys
    import outbox
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """
    )
    assert out.strip() == "[]"


# --- the publisher: a span per batch sent ----------------------------------------------


def _spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return list(exporter.get_finished_spans())


def _enqueued(provider: TracerProvider, topic: str = "orders", **kw: Any) -> ClaimedMessage:
    """A claimed message enqueued within a span of ``provider`` (its headers as stored)."""
    with provider.get_tracer("service").start_as_current_span("request"):
        intent = build_intent(topic, b"raw")
    headers = list(zip(intent.header_names, intent.header_values, strict=True))
    return _message(topic, headers=headers, **kw)


def _context_of(m: ClaimedMessage) -> tuple[int, int]:
    parent = dict(m.headers)["traceparent"].decode().split("-")
    return int(parent[1], 16), int(parent[2], 16)


def test_a_sent_batch_is_one_producer_span_linked_to_each_enqueuing_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """One span per batch, named after its topic, with one link per distinct valid context."""
    first = _enqueued(provider, key=b"a")
    same_span = _message(key=b"b", headers=first.headers)  # enqueued in the same request
    second = _enqueued(provider, key=b"c")
    untraced = _message(key=b"d")
    garbled = _message(key=b"e", headers=[("traceparent", b"00-not-a-trace-context-01")])
    exporter.clear()  # the enqueuing spans
    events: list[str] = []
    store = FakeStore(events, [_batch(first, same_span, second, untraced, garbled)])
    publisher = _publisher(store, FakeSink(events), spans=batch_spans(provider))

    publisher.run_once()

    (span,) = _spans(exporter)
    assert span.name == "send orders"
    assert span.kind is SpanKind.PRODUCER
    assert dict(span.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.batch.message_count": 5,
        "messaging.destination.name": "orders",
        "outbox.batch.id": 7,
        "outbox.batch.delivered_count": 5,
    }
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
        _context_of(first),
        _context_of(second),
    ]
    assert span.status.status_code is StatusCode.UNSET


def test_a_batch_of_several_topics_has_no_destination(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Its span is named after the operation alone."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message("orders"), _message("payments"))])
    sink = FakeSink(events, {"orders": 3, "payments": 3})
    _publisher(store, sink, spans=batch_spans(provider)).run_once()

    (span,) = _spans(exporter)
    assert span.name == "send"
    assert "messaging.destination.name" not in (span.attributes or {})


def test_a_batch_not_delivered_whole_ends_with_an_error_status(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """One record without an answer: the span's status is an error that counts the outcomes."""
    ok, unknown = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_batch(ok, unknown)])
    sink = FakeSink(events)
    sink.reports = {
        unknown.id: SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)
    }
    _publisher(store, sink, spans=batch_spans(provider)).run_once()

    assert [s.state for s in store.settled[0]] == [State.DELIVERED, State.UNCERTAIN]
    (span,) = _spans(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "1 of 2 messages not delivered: 1 uncertain"
    assert (span.attributes or {})["outbox.batch.delivered_count"] == 1


def test_messages_taken_over_before_sending_count_as_not_delivered(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A message recovered by another publisher before the mark is not delivered by this batch."""
    kept, lost = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_batch(kept, lost)])
    store.lost_before_sending = {lost.id}
    _publisher(store, FakeSink(events), spans=batch_spans(provider)).run_once()

    (span,) = _spans(exporter)
    assert span.status.description == "1 of 2 messages not delivered: 1 taken over"


def test_a_fenced_batch_ends_with_an_error_status_and_is_not_settled(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Fenced at the commit, nothing is settled: the span says so."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message())])
    sink = FakeSink(events)
    sink.commit_ends = TransactionEnd.FENCED
    _publisher(store, sink, TRANSACTIONAL, spans=batch_spans(provider)).run_once()

    assert store.settled == []
    (span,) = _spans(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description is not None
    assert span.status.description.startswith("not settled by this publisher")


def test_links_are_capped_and_the_rest_counted(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """More distinct enqueuing contexts than MAX_LINKS: the first MAX_LINKS are linked."""
    messages = [
        _message(key=None, headers=[("traceparent", _traceparent(_remote(i + 1, i + 1)))])
        for i in range(MAX_LINKS + 3)
    ]
    spans = batch_spans(provider)
    batch = _batch(*messages)
    spans.sending(batch)
    spans.ended(batch)

    (span,) = _spans(exporter)
    assert [link.context.span_id for link in span.links] == list(range(1, MAX_LINKS + 1))
    assert (span.attributes or {})["outbox.batch.links_dropped"] == 3


class _Untouchable(list[ClaimedMessage]):
    """A batch's message list that fails when anything reads its messages."""

    def __iter__(self) -> Iterator[ClaimedMessage]:
        raise AssertionError("the messages were read for a span that is not recorded")


@pytest.mark.parametrize(
    "not_recording",
    [trace.NoOpTracerProvider(), TracerProvider(sampler=ALWAYS_OFF)],
    ids=["no-op provider", "sampled out"],
)
def test_a_span_not_recorded_reads_no_message(not_recording: trace.TracerProvider) -> None:
    """A no-op provider, or a sampler that drops the span: no per-message work at all."""
    spans = batch_spans(not_recording)
    batch = Batch(id=1, messages=_Untouchable([_message()]), claimed_at=_batch().claimed_at)

    spans.sending(batch)
    spans.settled(batch, [])
    spans.ended(batch)


def test_without_opentelemetry_the_publisher_records_nothing_and_imports_none_of_it() -> None:
    """OpenTelemetry not installed: the loop gets the spans that do nothing."""
    out = _run_python(
        _BLOCK_OPENTELEMETRY
        + """
    from publisher.loop import Publisher
    from publisher.tracing import BatchSpans, batch_spans

    print(type(batch_spans()) is BatchSpans, len(attempts), imported())
    """
    )
    assert out.strip() == "True 1 []"
