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
    HeadersTooLarge,
    InvalidHeaders,
    InvalidIdempotencyKey,
    InvalidKey,
    InvalidMessage,
    InvalidTopic,
    InvalidValue,
    KeyTooLarge,
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
#: Default ceilings for the key and for all headers together (names and
#: values, UTF-8, each with the length Kafka stores before it: see
#: ``header_bytes``). With the default value ceiling, the largest message the
#: defaults accept (1,000,000 + 16,384 + 16,384 bytes) still leaves about
#: 15 kB of Kafka's default 1 MiB ``message.max.bytes`` for the record's
#: framing and the headers the library adds. Each publisher claim holds the
#: whole message in memory, so these also bound what one claim costs.
DEFAULT_MAX_KEY_BYTES = 16_384
DEFAULT_MAX_HEADER_BYTES = 16_384
#: Ceiling of an idempotency key, in UTF-8 bytes. The key is in a unique
#: btree index, whose entries PostgreSQL limits to about 2.7 kB: a longer key
#: would abort the caller's transaction on the server, so it is refused here.
MAX_IDEMPOTENCY_KEY_BYTES = 1_024

HeaderValue = bytes | bytearray | memoryview | str
Headers = Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]]


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


def _utf8(text: str, what: str, error: type[InvalidMessage]) -> bytes:
    """``text`` in UTF-8, or ``error`` naming ``what`` (a lone surrogate has no encoding)."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} is not valid Unicode: it has an unpaired surrogate "
            f"{text[exc.start : exc.end]!r} at position {exc.start}, which UTF-8 cannot encode"
        ) from exc


def _text(text: str, what: str, error: type[InvalidMessage]) -> str:
    """``text`` if PostgreSQL can store it as ``text``: UTF-8 and no NUL character."""
    _utf8(text, what, error)
    if "\x00" in text:
        at = text.index("\x00")
        raise error(
            f"{what} has a NUL character (\\x00) at position {at}; PostgreSQL text cannot hold it"
        )
    return text


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
        # Also refuses NUL and unpaired surrogates: neither is in Kafka's set.
        bad = sorted({c for c in topic if not _TOPIC_RE.fullmatch(c)})
        raise InvalidTopic(
            f"topic {topic!r} has characters Kafka refuses: {''.join(bad)!r}; "
            "only ASCII letters, digits, '.', '_' and '-' are allowed"
        )
    return topic


def encode_key(key: object, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES) -> bytes | None:
    """Encode a key given as bytes or str (UTF-8); ``None`` means unkeyed.

    The key is stored as ``bytea``, so it may hold any byte, NUL included.
    """
    if key is None:
        return None
    if isinstance(key, bytes):
        encoded = key
    elif isinstance(key, str):
        encoded = _utf8(key, "key", InvalidKey)
    elif isinstance(key, bytearray | memoryview):
        encoded = bytes(key)
    else:
        raise InvalidKey(f"key must be bytes or str, got {type(key).__name__}")
    if len(encoded) > max_key_bytes:
        raise KeyTooLarge(
            f"key is {len(encoded)} bytes once encoded; the configured maximum is {max_key_bytes}"
        )
    return encoded


def encode_value(value: object) -> tuple[bytes, bool]:
    """Encode a value; return the bytes and whether they are JSON we produced."""
    if isinstance(value, bytes):
        return value, False
    if isinstance(value, bytearray | memoryview):
        return bytes(value), False
    if isinstance(value, str):
        return _utf8(value, "value", InvalidValue), False
    if value is None:
        raise InvalidValue(
            "value is None; pass bytes, str or a JSON-serialisable object "
            "(Kafka tombstones are not supported)"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"value is not JSON-serialisable: {exc}") from exc
    except RecursionError as exc:
        raise InvalidValue(
            "value nests too deeply to serialise as JSON (or refers to itself in a way "
            "json cannot detect); flatten it or pass it already encoded as bytes"
        ) from exc
    return _utf8(text, "value (as JSON)", InvalidValue), True


def _varint_bytes(length: int) -> int:
    """How many bytes Kafka's record format takes to store ``length`` (a zigzag varint)."""
    zigzag, size = length << 1, 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


def header_bytes(name: bytes, value: bytes) -> int:
    """What one header takes in a Kafka record: its name and value, each after its length.

    The lengths are 1 to 3 bytes each for the sizes allowed here: thousands of
    tiny headers take several times their names and values, and would
    otherwise pass a ceiling on names and values alone only to be refused by
    the broker as too large.
    """
    return _varint_bytes(len(name)) + len(name) + _varint_bytes(len(value)) + len(value)


def encode_headers(
    headers: Headers | None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> tuple[list[str], list[bytes]]:
    """Encode headers given as a mapping or a list of ``(name, value)`` pairs.

    Names are stored as ``text`` (no NUL), values as ``bytea``; together, as a
    Kafka record stores them (``header_bytes``: UTF-8, each after its length),
    they may take at most ``max_header_bytes``.
    """
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
    total = 0
    for index, item in enumerate(items):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise InvalidHeaders(f"header {_short(item)} is not a (name, value) pair")
        name, value = item
        if not isinstance(name, str) or not name:
            raise InvalidHeaders(f"header name {_short(name)} must be a non-empty str")
        _text(name, f"header name {_short(name)}", InvalidHeaders)
        if name.lower() == ID_HEADER:
            # In any case: a consumer may read header names case-insensitively.
            raise InvalidHeaders(f"header {name!r} is reserved: the publisher sets {ID_HEADER!r}")
        if isinstance(value, str):
            encoded = _utf8(value, f"header {name!r}'s value", InvalidHeaders)
        elif isinstance(value, bytes):
            encoded = value
        elif isinstance(value, bytearray | memoryview):
            encoded = bytes(value)
        else:
            raise InvalidHeaders(
                f"header {name!r} has a {type(value).__name__} value; it must be bytes "
                "(or bytearray, memoryview) or str"
            )
        total += header_bytes(name.encode(), encoded)
        if total > max_header_bytes:
            raise HeadersTooLarge(
                f"headers take at least {total} bytes in a Kafka record (names and values, "
                f"UTF-8, each after its length; counted up to header {index}, {name[:40]!r}); "
                f"the configured maximum is {max_header_bytes}"
            )
        names.append(name)
        values.append(encoded)
    return names, values


def validate_idempotency_key(idempotency_key: object) -> str | None:
    """Return the key if it can be stored and indexed: a non-empty str, no NUL, <= 1,024 bytes."""
    if idempotency_key is None:
        return None
    if not isinstance(idempotency_key, str) or not idempotency_key:
        raise InvalidIdempotencyKey(
            f"idempotency_key must be a non-empty str, got {_short(idempotency_key)}"
        )
    _text(idempotency_key, "idempotency_key", InvalidIdempotencyKey)
    size = len(idempotency_key.encode())
    if size > MAX_IDEMPOTENCY_KEY_BYTES:
        raise InvalidIdempotencyKey(
            f"idempotency_key is {size} bytes in UTF-8; at most {MAX_IDEMPOTENCY_KEY_BYTES} "
            "are allowed (it is kept in a unique index): hash a longer one"
        )
    return idempotency_key


def _short(thing: object, limit: int = 60) -> str:
    """``repr`` of ``thing`` cut to ``limit`` characters, for an error message."""
    text = repr(thing)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def build_intent(
    topic: object,
    value: object,
    *,
    key: object = None,
    headers: Headers | None = None,
    idempotency_key: object = None,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Intent:
    """Validate and encode one intent; raise an ``InvalidMessage`` naming the problem.

    With OpenTelemetry installed and a span current, the headers also get
    that span's ``traceparent`` (and ``tracestate``), unless the caller set
    either (see ``outbox.tracing``). The header ceiling applies to the
    caller's headers; the few the library adds are not counted.
    """
    topic = validate_topic(topic)
    encoded_key = encode_key(key, max_key_bytes)
    encoded_value, is_json = encode_value(value)
    if len(encoded_value) > max_value_bytes:
        raise ValueTooLarge(
            f"value is {len(encoded_value)} bytes once encoded; "
            f"the configured maximum is {max_value_bytes}"
        )
    names, values = encode_headers(headers, max_header_bytes)
    checked_key = validate_idempotency_key(idempotency_key)
    # Both enqueue paths (one message or many, sync or async) build their
    # intents here, so each message gets the span current when it was built.
    add_trace_context(names, values)
    # Kafka's header names are case-sensitive, but many consumers read this one
    # as HTTP does: a "Content-Type" of the caller's is not doubled.
    if is_json and all(name.lower() != CONTENT_TYPE_HEADER for name in names):
        names.append(CONTENT_TYPE_HEADER)
        values.append(JSON_CONTENT_TYPE)
    return Intent(
        id=new_message_id(),
        topic=topic,
        key=encoded_key,
        value=encoded_value,
        header_names=names,
        header_values=values,
        idempotency_key=checked_key,
    )
