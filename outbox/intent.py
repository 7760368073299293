"""Turning ``enqueue`` arguments into a publication intent, or a clear error.

All checks run in Python before any SQL is sent, which is what keeps the
caller's transaction usable when an argument is wrong.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from outbox.errors import (
    InvalidHeaders,
    InvalidIdempotencyKey,
    InvalidKey,
    InvalidTopic,
    InvalidValue,
    ValueTooLarge,
)
from outbox.ids import new_message_id
from outbox.tracing import add_trace_context

#: Header that carries the message id to Kafka; reconciliation looks for it.
ID_HEADER = "outbox-id"
#: Header added to values the library serialised as JSON.
CONTENT_TYPE_HEADER = "content-type"
JSON_CONTENT_TYPE = b"application/json"

#: Kafka's limit on topic name length and its legal characters.
MAX_TOPIC_LENGTH = 249
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]+")

#: Default ceiling for an encoded value: just under Kafka's default
#: ``message.max.bytes`` (1 MiB) so that key, headers and framing still fit.
DEFAULT_MAX_VALUE_BYTES = 1_000_000

Headers = Mapping[str, bytes | str] | Iterable[tuple[str, bytes | str]]


@dataclass(frozen=True, slots=True)
class Intent:
    """One validated, encoded publication intent, ready to be inserted."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    header_names: list[str]
    header_values: list[bytes]
    idempotency_key: str | None


def validate_topic(topic: object) -> str:
    """Return ``topic`` if Kafka would accept it as a topic name."""
    if not isinstance(topic, str):
        raise InvalidTopic(f"topic must be a str, got {type(topic).__name__}")
    if not topic:
        raise InvalidTopic("topic must not be empty")
    if topic in {".", ".."}:
        raise InvalidTopic(f"topic {topic!r} is not allowed by Kafka")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidTopic(
            f"topic is {len(topic)} characters long; Kafka allows at most {MAX_TOPIC_LENGTH}"
        )
    if not _TOPIC_RE.fullmatch(topic):
        bad = sorted({c for c in topic if not _TOPIC_RE.fullmatch(c)})
        raise InvalidTopic(
            f"topic {topic!r} has characters Kafka refuses: {''.join(bad)!r}; "
            "only ASCII letters, digits, '.', '_' and '-' are allowed"
        )
    return topic


def encode_key(key: object) -> bytes | None:
    """Encode a key given as bytes or str (UTF-8); ``None`` means unkeyed."""
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytearray | memoryview):
        return bytes(key)
    raise InvalidKey(f"key must be bytes or str, got {type(key).__name__}")


def encode_value(value: object) -> tuple[bytes, bool]:
    """Encode a value; return the bytes and whether they are JSON we produced."""
    if isinstance(value, bytes):
        return value, False
    if isinstance(value, bytearray | memoryview):
        return bytes(value), False
    if isinstance(value, str):
        return value.encode(), False
    if value is None:
        raise InvalidValue(
            "value is None; pass bytes, str or a JSON-serialisable object "
            "(Kafka tombstones are not supported)"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"value is not JSON-serialisable: {exc}") from exc
    return text.encode(), True


def encode_headers(headers: Headers | None) -> tuple[list[str], list[bytes]]:
    """Encode headers given as a mapping or a list of ``(name, value)`` pairs."""
    if headers is None:
        return [], []
    if isinstance(headers, str | bytes):
        raise InvalidHeaders("headers must be a mapping or a list of (name, value) pairs")
    pairs: Iterable[Any] = headers.items() if isinstance(headers, Mapping) else headers
    names: list[str] = []
    values: list[bytes] = []
    try:
        items = list(pairs)
    except TypeError as exc:
        raise InvalidHeaders(
            f"headers must be a mapping or a list of (name, value) pairs, "
            f"got {type(headers).__name__}"
        ) from exc
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise InvalidHeaders(f"header {item!r} is not a (name, value) pair")
        name, value = item
        if not isinstance(name, str) or not name:
            raise InvalidHeaders(f"header name {name!r} must be a non-empty str")
        if name == ID_HEADER:
            raise InvalidHeaders(f"header {ID_HEADER!r} is reserved: the publisher sets it")
        if isinstance(value, str):
            encoded = value.encode()
        elif isinstance(value, bytes):
            encoded = value
        else:
            raise InvalidHeaders(
                f"header {name!r} has a {type(value).__name__} value; it must be bytes or str"
            )
        names.append(name)
        values.append(encoded)
    return names, values


def build_intent(
    topic: object,
    value: object,
    *,
    key: object = None,
    headers: Headers | None = None,
    idempotency_key: object = None,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
) -> Intent:
    """Validate and encode one intent; raise an ``InvalidMessage`` naming the problem.

    With OpenTelemetry installed and a span current, the headers also get
    that span's ``traceparent`` (and ``tracestate``), unless the caller set
    either (see ``outbox.tracing``).
    """
    topic = validate_topic(topic)
    encoded_key = encode_key(key)
    encoded_value, is_json = encode_value(value)
    if len(encoded_value) > max_value_bytes:
        raise ValueTooLarge(
            f"value is {len(encoded_value)} bytes once encoded; "
            f"the configured maximum is {max_value_bytes}"
        )
    names, values = encode_headers(headers)
    # Both enqueue paths (one message or many, sync or async) build their
    # intents here, so each message gets the span current when it was built.
    add_trace_context(names, values)
    if is_json and CONTENT_TYPE_HEADER not in names:
        names.append(CONTENT_TYPE_HEADER)
        values.append(JSON_CONTENT_TYPE)
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str) or not idempotency_key
    ):
        raise InvalidIdempotencyKey(
            f"idempotency_key must be a non-empty str, got {idempotency_key!r}"
        )
    return Intent(
        id=new_message_id(),
        topic=topic,
        key=encoded_key,
        value=encoded_value,
        header_names=names,
        header_values=values,
        idempotency_key=idempotency_key,
    )
