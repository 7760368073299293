"""A producer span per batch sent, linked to the spans that enqueued its messages.

With ``opentelemetry-api`` installed (the ``otel`` extra), each batch the
loop sends is recorded as a ``PRODUCER`` span named ``send <topic>`` (``send``
when the batch has several topics), after OpenTelemetry's messaging
semantic conventions: ``messaging.system=kafka``,
``messaging.operation.type=send``, ``messaging.batch.message_count``,
``messaging.destination.name`` when the batch has one topic, and the batch
id as ``outbox.batch.id``. It links to the span context each message
carries in its ``traceparent``/``tracestate`` headers (stored by
``outbox.enqueue``), once per distinct context and at most ``MAX_LINKS``.
It ends with an error status unless every message of the batch was
delivered.

Spans go to the global tracer provider: a no-op unless the process
configured an SDK (``opentelemetry-instrument outbox-publisher``, say). A
no-op provider (or a sampler that drops the span) costs a span start per
batch and nothing per message: headers are read only for a recording span.
Without OpenTelemetry, ``batch_spans`` returns ``BatchSpans``, whose calls
do nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox.states import State
from outbox.tracing import TRACEPARENT, TRACESTATE
from publisher.store import Batch, ClaimedMessage, Settlement

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: batches are not traced
    _OTEL = False
else:
    _OTEL = True

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext, TracerProvider

#: Links per span, at most: the SDK's default span link limit
#: (``OTEL_SPAN_LINK_COUNT_LIMIT``). Parsing a context costs about 10 us, so
#: beyond it the distinct trace headers are only counted, in
#: ``outbox.batch.links_dropped``; the messages still carry them to Kafka.
MAX_LINKS = 128


class BatchSpans:
    """What the loop tells tracing about a batch; this base records nothing.

    ``sending`` when the batch's hand-over begins, ``settled`` once its
    outcomes are recorded, ``ended`` when the loop lets the batch go (after
    ``settled``, or after an error or a fence that left it unsettled).
    """

    def sending(self, batch: Batch) -> None:
        """The batch begins to be sent."""

    def settled(self, batch: Batch, settlements: Sequence[Settlement]) -> None:
        """The batch's outcomes were recorded."""

    def ended(self, batch: Batch) -> None:
        """The loop is done with the batch."""


def batch_spans(tracer_provider: TracerProvider | None = None) -> BatchSpans:
    """Spans on ``tracer_provider`` (the global one by default) with OpenTelemetry, else none."""
    if not _OTEL:
        return BatchSpans()
    return _TracedBatches(trace.get_tracer(__name__, tracer_provider=tracer_provider))


@dataclass
class _Traced:
    """A batch's recording span, and its messages' outcomes once settled."""

    span: Span
    outcomes: Counter[State] | None = None


class _TracedBatches(BatchSpans):
    """One span per batch, open from its hand-over until the loop lets it go."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self._propagator = TraceContextTextMapPropagator()
        #: Recording spans by batch id; only the loop's thread touches it.
        self._traced: dict[int, _Traced] = {}

    def sending(self, batch: Batch) -> None:
        # Only what costs nothing per message is known to the sampler: the
        # destination is set once the span is known to be recorded.
        span = self._tracer.start_span(
            "send",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.batch.message_count": len(batch.messages),
                "outbox.batch.id": batch.id,
            },
        )
        if not span.is_recording():
            return
        topics = {m.topic for m in batch.messages}
        if len(topics) == 1:
            (topic,) = topics
            span.update_name(f"send {topic}")
            span.set_attribute("messaging.destination.name", topic)
        dropped = self._link(span, batch.messages)
        if dropped:
            span.set_attribute("outbox.batch.links_dropped", dropped)
        self._traced[batch.id] = _Traced(span)

    def _link(self, span: Span, messages: Sequence[ClaimedMessage]) -> int:
        """Link the span to each distinct valid enqueuing context; return how many were left.

        Messages enqueued in one span carry the same headers: they are parsed
        once. Past ``MAX_LINKS`` links nothing more is parsed, only counted.
        """
        seen: set[tuple[bytes, bytes | None]] = set()
        linked = dropped = 0
        for m in messages:
            headers = _trace_headers(m.headers)
            if headers is None or headers in seen:
                continue
            seen.add(headers)
            if linked == MAX_LINKS:
                dropped += 1
                continue
            context = self._context(*headers)
            if context is not None:
                span.add_link(context)
                linked += 1
        return dropped

    def _context(self, traceparent: bytes, tracestate: bytes | None) -> SpanContext | None:
        """The span context the headers hold, if it is valid."""
        # Not ASCII: the propagator refuses the replacement characters.
        carrier = {TRACEPARENT: traceparent.decode("ascii", errors="replace")}
        if tracestate is not None:
            carrier[TRACESTATE] = tracestate.decode("ascii", errors="replace")
        context = trace.get_current_span(self._propagator.extract(carrier)).get_span_context()
        return context if context.is_valid else None

    def settled(self, batch: Batch, settlements: Sequence[Settlement]) -> None:
        traced = self._traced.get(batch.id)
        if traced is not None:
            traced.outcomes = Counter(s.state for s in settlements)

    def ended(self, batch: Batch) -> None:
        traced = self._traced.pop(batch.id, None)
        if traced is None:
            return
        span, outcomes = traced.span, traced.outcomes
        if outcomes is None:
            span.set_status(
                trace.StatusCode.ERROR,
                "not settled by this publisher (its session was fenced, or an error stopped it)",
            )
        else:
            claimed = len(batch.messages)
            delivered = outcomes.pop(State.DELIVERED, 0)
            span.set_attribute("outbox.batch.delivered_count", delivered)
            if delivered < claimed:
                # Messages without a settlement were recovered by another
                # publisher before this one began sending them.
                lost = claimed - delivered - outcomes.total()
                why = [f"{n} {state.value}" for state, n in sorted(outcomes.items())]
                why += [f"{lost} taken over"] if lost else []
                span.set_status(
                    trace.StatusCode.ERROR,
                    f"{claimed - delivered} of {claimed} messages not delivered: {', '.join(why)}",
                )
        span.end()


def _trace_headers(headers: Sequence[tuple[str, bytes]]) -> tuple[bytes, bytes | None] | None:
    """A message's first ``traceparent`` and ``tracestate`` (any letter case), if it has the
    first."""
    traceparent = tracestate = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == TRACEPARENT and traceparent is None:
            traceparent = value
        elif lowered == TRACESTATE and tracestate is None:
            tracestate = value
    return None if traceparent is None else (traceparent, tracestate)
