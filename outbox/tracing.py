"""Trace context for enqueued messages: the current span's W3C ``traceparent``.

When ``opentelemetry-api`` is installed (the ``otel`` extra) and a span is
current, each enqueued message carries that span's ``traceparent`` header
(and ``tracestate`` when it is not empty), written by OpenTelemetry's own
W3C propagator. The headers travel with the message to Kafka, so a consumer
that extracts them continues the trace of the request that enqueued it.

OpenTelemetry is imported on the first enqueue, not when ``outbox`` is
imported, and only once: without it installed nothing of it is imported
and nothing is added.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

#: The W3C Trace Context header names, as the propagator writes them.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})

#: The longest ``tracestate`` stored with a message, in characters: what W3C
#: Trace Context asks every vendor to propagate. OpenTelemetry caps one it
#: extracts from a request at 8,192, but not one built in the process (32
#: members of up to 513 characters); uncapped, it could take a message past
#: Kafka's default size limit, counted in no limit of the library's.
MAX_TRACESTATE = 512
#: Members longer than this go first when a ``tracestate`` is cut (W3C Trace Context).
_LONG_MEMBER = 128

_Inject = Callable[[], dict[str, str]]


def bounded_tracestate(value: str) -> str:
    """``value`` cut to at most ``MAX_TRACESTATE`` characters as W3C Trace Context says a
    vendor may cut it: members longer than 128 characters removed first, then members from
    the end (the most recently added ones are at the start); ``""`` when none is left."""
    if len(value) <= MAX_TRACESTATE:
        return value
    members = [m.strip() for m in value.split(",") if m.strip()]
    if len(",".join(members)) > MAX_TRACESTATE:
        members = [m for m in members if len(m) <= _LONG_MEMBER]
    while members and len(",".join(members)) > MAX_TRACESTATE:
        members.pop()
    return ",".join(members)


@functools.cache
def _injector() -> _Inject | None:
    """The current context's trace headers as a dict, or ``None`` without OpenTelemetry.

    Cached: the import is attempted once per process, found or not.
    """
    try:
        # Optional, and imported only when first needed.
        from opentelemetry import trace  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
            TraceContextTextMapPropagator,
        )
    except ImportError:
        return None
    propagator = TraceContextTextMapPropagator()

    def inject() -> dict[str, str]:
        carrier: dict[str, str] = {}
        if trace.get_current_span().get_span_context().is_valid:
            propagator.inject(carrier)
        return carrier

    return inject


def add_trace_context(names: list[str], values: list[bytes]) -> None:
    """Append the current span's ``traceparent``/``tracestate`` to the headers in place.

    Nothing is added when the caller set either header already (names
    compared case-insensitively): the caller's trace context wins whole,
    since a ``tracestate`` belongs to the ``traceparent`` beside it. Nothing
    is added without OpenTelemetry or without a valid current span. A
    ``tracestate`` is cut to ``MAX_TRACESTATE`` characters (``bounded_tracestate``).
    """
    inject = _injector()
    if inject is None:
        return
    if any(name.lower() in TRACE_HEADERS for name in names):
        return
    for name, value in inject().items():
        text = bounded_tracestate(value) if name == TRACESTATE else value
        if text:
            names.append(name)
            values.append(text.encode())
