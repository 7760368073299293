"""Validation and encoding of enqueue arguments (outbox/intent.py), all before any SQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
import outbox.aio
from outbox import Message, Outbox
from outbox.errors import (
    ConnectionNotSupported,
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
from outbox.intent import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_KEY_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_TOPIC_LENGTH,
    build_intent,
    encode_headers,
    encode_key,
    encode_value,
    header_bytes,
    validate_topic,
)

# --- validate_topic ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topic",
    [
        "orders",
        "a",
        "x" * 249,
        "orders.v1",
        "orders_v1",
        "orders-v1",
        "Orders.V1_eu-west-1",
        "...a",
        "0123456789",
    ],
)
def test_validate_topic_accepts_names_kafka_accepts(topic: str) -> None:
    """A topic of ASCII letters, digits, '.', '_' and '-' up to 249 characters is returned as is."""
    assert validate_topic(topic) == topic


def test_max_topic_length_is_kafkas() -> None:
    """The topic length limit is Kafka's 249 characters."""
    assert MAX_TOPIC_LENGTH == 249


@pytest.mark.parametrize(
    ("topic", "fragment"),
    [
        (None, "must be a str, got NoneType"),
        (42, "must be a str, got int"),
        (b"orders", "must be a str, got bytes"),
        ("", "must not be empty"),
        (".", "not allowed"),
        ("..", "not allowed"),
        ("x" * 250, "250 characters long"),
        ("my orders", "characters Kafka refuses: ' '"),
        ("héllo", "characters Kafka refuses: 'é'"),
        ("orders/v1", "characters Kafka refuses: '/'"),
        ("orders\n", "characters Kafka refuses"),
    ],
)
def test_validate_topic_refuses_with_a_message_naming_the_problem(
    topic: object, fragment: str
) -> None:
    """A topic Kafka would refuse raises InvalidTopic whose message names what is wrong."""
    with pytest.raises(InvalidTopic) as caught:
        validate_topic(topic)
    assert fragment in str(caught.value)


def test_invalid_topic_is_an_invalid_message_and_a_value_error() -> None:
    """InvalidTopic can be caught as outbox.InvalidMessage and as ValueError."""
    with pytest.raises(InvalidTopic) as caught:
        validate_topic("")
    assert isinstance(caught.value, InvalidMessage)
    assert isinstance(caught.value, ValueError)


# --- encode_key -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (None, None),
        (b"\x00\xffraw", b"\x00\xffraw"),
        (b"", b""),
        ("customer-7", b"customer-7"),
        ("héllo", "héllo".encode()),
        (bytearray(b"abc"), b"abc"),
        (memoryview(b"abc"), b"abc"),
    ],
)
def test_encode_key(key: object, expected: bytes | None) -> None:
    """A key is None (unkeyed), bytes as given, str as UTF-8, or a bytes-like copied to bytes."""
    encoded = encode_key(key)
    assert encoded == expected
    assert encoded is None or type(encoded) is bytes


@pytest.mark.parametrize("key", [7, 1.5, ["a"], {"k": 1}])
def test_encode_key_refuses_other_types(key: object) -> None:
    """A key that is neither bytes nor str raises InvalidKey naming its type."""
    with pytest.raises(InvalidKey, match=type(key).__name__):
        encode_key(key)


# --- encode_value -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"\x00raw", b"\x00raw"),
        (b"", b""),
        ("plain text", b"plain text"),
        ("héllo", "héllo".encode()),
        (bytearray(b"abc"), b"abc"),
    ],
)
def test_encode_value_passes_bytes_and_text_through(value: object, expected: bytes) -> None:
    """Bytes are kept and str is encoded as UTF-8, neither marked as JSON."""
    assert encode_value(value) == (expected, False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"id": 42, "items": [1, 2]}, b'{"id":42,"items":[1,2]}'),
        ([1, "a", None], b'[1,"a",null]'),
        (42, b"42"),
        (True, b"true"),
        ({}, b"{}"),
    ],
)
def test_encode_value_serialises_other_values_as_compact_json(
    value: object, expected: bytes
) -> None:
    """A dict, list or number becomes compact JSON bytes and is marked as JSON."""
    assert encode_value(value) == (expected, True)


def test_encode_value_keeps_non_ascii_as_utf8_in_json() -> None:
    """Non-ASCII text inside a JSON value is written as UTF-8, not as \\u escapes."""
    encoded, is_json = encode_value({"name": "héllo ключ"})
    assert is_json
    assert encoded == '{"name":"héllo ключ"}'.encode()
    assert b"\\u" not in encoded
    assert json.loads(encoded) == {"name": "héllo ключ"}


def test_encode_value_refuses_none_mentioning_tombstones() -> None:
    """A None value raises InvalidValue that says Kafka tombstones are not supported."""
    with pytest.raises(InvalidValue, match="tombstones"):
        encode_value(None)


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        object(),
        {"when": object()},
        float("nan"),
        float("inf"),
        {"x": float("nan")},
    ],
)
def test_encode_value_refuses_what_is_not_json(value: object) -> None:
    """A value that is not strictly JSON-serialisable (sets, objects, NaN) raises InvalidValue."""
    with pytest.raises(InvalidValue, match="not JSON-serialisable"):
        encode_value(value)


# --- encode_headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "names", "values"),
    [
        (None, [], []),
        ({}, [], []),
        ([], [], []),
        ({"trace": b"\x01", "source": "svc"}, ["trace", "source"], [b"\x01", b"svc"]),
        ([("trace", b"\x01"), ("source", "svc")], ["trace", "source"], [b"\x01", b"svc"]),
        ([["trace", "1"]], ["trace"], [b"1"]),
        (
            [("tag", "a"), ("other", b"x"), ("tag", "b"), ("tag", "c")],
            ["tag", "other", "tag", "tag"],
            [b"a", b"x", b"b", b"c"],
        ),
        ({"name": "héllo"}, ["name"], ["héllo".encode()]),
        (
            {"a": bytearray(b"\x01"), "b": memoryview(b"\x02")},
            ["a", "b"],
            [b"\x01", b"\x02"],
        ),
    ],
)
def test_encode_headers(headers: Any, names: list[str], values: list[bytes]) -> None:
    """Headers from a mapping or pairs keep their order, repeats, and encode str values as UTF-8."""
    assert encode_headers(headers) == (names, values)


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ([(1, b"x")], "header name 1 must be a non-empty str"),
        ([(b"trace", b"x")], "must be a non-empty str"),
        ({"": b"x"}, "header name '' must be a non-empty str"),
        ({"n": 5}, "header 'n' has a int value"),
        ({"n": None}, "header 'n' has a NoneType value"),
        ([("a", b"x", b"y")], "is not a (name, value) pair"),
        ([("a",)], "is not a (name, value) pair"),
        (["ab"], "'ab' is not a (name, value) pair"),
        ("trace", "must be a mapping or a list"),
        (b"trace", "must be a mapping or a list"),
        (42, "got int"),
        ({"outbox-id": b"x"}, "reserved"),
        ([("a", b"1"), ("outbox-id", "x")], "reserved"),
        ({"Outbox-Id": b"x"}, "header 'Outbox-Id' is reserved"),
        ({"OUTBOX-ID": "x"}, "reserved"),
    ],
)
def test_encode_headers_refuses_with_a_message_naming_the_problem(
    headers: Any, fragment: str
) -> None:
    """Bad names, values, items or containers, and the reserved id, raise InvalidHeaders."""
    with pytest.raises(InvalidHeaders) as caught:
        encode_headers(headers)
    assert fragment in str(caught.value)


# --- build_intent -----------------------------------------------------------------------------


def _header_pairs(names: Iterable[str], values: Iterable[bytes]) -> list[tuple[str, bytes]]:
    return list(zip(names, values, strict=True))


def test_build_intent_adds_json_content_type_for_json_values() -> None:
    """A value serialised as JSON gets content-type: application/json after the user's headers."""
    intent = build_intent("orders", {"id": 1}, headers={"trace": "t"})
    assert intent.value == b'{"id":1}'
    assert _header_pairs(intent.header_names, intent.header_values) == [
        ("trace", b"t"),
        ("content-type", b"application/json"),
    ]


@pytest.mark.parametrize("value", [b'{"id":1}', '{"id":1}'])
def test_build_intent_adds_no_content_type_for_bytes_or_text(value: bytes | str) -> None:
    """A value given as bytes or str gets no content-type header from the library."""
    intent = build_intent("orders", value)
    assert "content-type" not in intent.header_names


def test_build_intent_keeps_the_callers_content_type() -> None:
    """A JSON value whose caller set content-type keeps that one header and gets no second."""
    intent = build_intent("orders", {"id": 1}, headers=[("content-type", b"application/x-custom")])
    assert _header_pairs(intent.header_names, intent.header_values) == [
        ("content-type", b"application/x-custom")
    ]


@pytest.mark.parametrize("name", ["Content-Type", "CONTENT-TYPE"])
def test_build_intent_keeps_the_callers_content_type_in_any_case(name: str) -> None:
    """A caller's content type named in another letter case is not doubled by ours."""
    intent = build_intent("orders", {"id": 1}, headers=[(name, "application/x-custom")])
    assert _header_pairs(intent.header_names, intent.header_values) == [
        (name, b"application/x-custom")
    ]


def test_build_intent_carries_every_field() -> None:
    """The intent holds the validated topic, the encoded key and value, and the idempotency key."""
    intent = build_intent("orders", "v", key="customer-7", idempotency_key="order-42")
    assert (intent.topic, intent.key, intent.value, intent.idempotency_key) == (
        "orders",
        b"customer-7",
        b"v",
        "order-42",
    )


@pytest.mark.parametrize(
    ("value", "max_value_bytes"),
    [(b"x" * 10, 10), ({"a": 1}, len(b'{"a":1}')), ("é" * 5, 10)],
)
def test_build_intent_accepts_a_value_of_exactly_the_maximum(
    value: object, max_value_bytes: int
) -> None:
    """An encoded value exactly max_value_bytes long is accepted."""
    intent = build_intent("orders", value, max_value_bytes=max_value_bytes)
    assert len(intent.value) == max_value_bytes


@pytest.mark.parametrize(
    ("value", "max_value_bytes"),
    [(b"x" * 11, 10), ({"a": 10}, len(b'{"a":1}')), ("é" * 5, 9)],
)
def test_build_intent_refuses_a_value_over_the_maximum(value: object, max_value_bytes: int) -> None:
    """An encoded value one byte over max_value_bytes raises ValueTooLarge, an InvalidValue
    (as KeyTooLarge is an InvalidKey and HeadersTooLarge an InvalidHeaders)."""
    with pytest.raises(ValueTooLarge, match=f"maximum is {max_value_bytes}"):
        build_intent("orders", value, max_value_bytes=max_value_bytes)
    assert issubclass(ValueTooLarge, InvalidValue)


@pytest.mark.parametrize("idempotency_key", ["", 42, b"order-42", ["k"]])
def test_build_intent_refuses_a_bad_idempotency_key(idempotency_key: object) -> None:
    """An idempotency key that is not a non-empty str raises InvalidIdempotencyKey."""
    with pytest.raises(InvalidIdempotencyKey, match="non-empty str"):
        build_intent("orders", b"v", idempotency_key=idempotency_key)


def test_build_intent_gives_each_intent_a_distinct_id() -> None:
    """Every intent built gets an id of its own, even for identical arguments."""
    ids = {build_intent("orders", b"same", key="k").id for _ in range(500)}
    assert len(ids) == 500


# --- Outbox.enqueue_many: validation before the connection --------------------------------------


def test_enqueue_many_validates_every_message_before_looking_at_the_connection() -> None:
    """An invalid message raises InvalidMessage naming its position before conn is looked at."""
    messages = [Message("orders", {"id": 1}), Message("", {"id": 2})]
    with pytest.raises(InvalidMessage) as caught:
        Outbox().enqueue_many(object(), messages)
    assert not isinstance(caught.value, ConnectionNotSupported)
    assert isinstance(caught.value, InvalidTopic)
    assert str(caught.value).startswith("message 1: ")
    assert "must not be empty" in str(caught.value)


def test_enqueue_many_keeps_the_specific_error_type() -> None:
    """A value over the Outbox's max_value_bytes raises ValueTooLarge naming message 0."""
    with pytest.raises(ValueTooLarge, match=r"^message 0: value is 6 bytes"):
        Outbox(max_value_bytes=5).enqueue_many(object(), [Message("orders", b"123456")])


@pytest.mark.parametrize(
    ("item", "kind"),
    [(("orders", b"v"), "tuple"), ({"topic": "orders", "value": b"v"}, "dict"), ("orders", "str")],
)
def test_enqueue_many_names_an_item_that_is_not_a_message(item: object, kind: str) -> None:
    """A tuple, dict or str among the messages raises InvalidMessage naming its position."""
    messages: list[Any] = [Message("orders", b"v"), item]
    with pytest.raises(
        InvalidMessage, match=rf"^message 1: expected an outbox.Message, got {kind}$"
    ):
        Outbox().enqueue_many(object(), messages)


@pytest.mark.parametrize(
    ("messages", "shown"),
    [
        (Message("orders", b"v"), r"got Message \(put the one message in a list\)$"),
        (None, "got NoneType$"),
    ],
    ids=["one-message", "none"],
)
def test_enqueue_many_names_messages_that_are_not_an_iterable(messages: Any, shown: str) -> None:
    """One Message, or None, instead of a list raises InvalidMessage, not a TypeError."""
    with pytest.raises(
        InvalidMessage, match=rf"^messages must be an iterable of outbox.Message, {shown}"
    ):
        Outbox().enqueue_many(object(), messages)


@pytest.mark.parametrize(
    ("setting", "value", "error", "text"),
    [
        ("max_value_bytes", -1, ValueError, "max_value_bytes must be at least 1, got -1"),
        ("max_key_bytes", 0, ValueError, "max_key_bytes must be at least 1, got 0"),
        ("max_header_bytes", "1000", TypeError, "max_header_bytes must be an int, got str"),
        ("max_value_bytes", True, TypeError, "max_value_bytes must be an int, got bool"),
    ],
)
def test_an_outbox_with_a_limit_that_is_not_a_positive_int_is_refused_at_once(
    setting: str, value: object, error: type[Exception], text: str
) -> None:
    """A bad limit is named when the Outbox is made, not by every enqueue after."""
    with pytest.raises(error, match=f"^Outbox {text}$"):
        Outbox(**{setting: value})  # type: ignore[arg-type]


def test_enqueue_many_with_valid_messages_refuses_an_unsupported_connection() -> None:
    """Valid messages with an unsupported connection object raise ConnectionNotSupported."""
    with pytest.raises(ConnectionNotSupported, match=r"got builtins\.object"):
        Outbox().enqueue_many(object(), [Message("orders", {"id": 1})])


def test_module_level_enqueue_validates_before_the_connection() -> None:
    """outbox.enqueue raises InvalidHeaders for a reserved header before checking the connection."""
    with pytest.raises(InvalidHeaders, match="reserved"):
        outbox.enqueue(object(), "orders", b"v", headers={"outbox-id": b"x"})


# --- limits on key, headers and idempotency key -----------------------------------------------


def test_default_limits_fit_kafkas_default_message_size() -> None:
    """The largest message the defaults accept fits Kafka's default message.max.bytes
    (1 MiB) with room left for the record's framing."""
    largest = DEFAULT_MAX_VALUE_BYTES + DEFAULT_MAX_KEY_BYTES + DEFAULT_MAX_HEADER_BYTES
    assert largest + 10_000 <= 1_048_576


@pytest.mark.parametrize("key", [b"k" * DEFAULT_MAX_KEY_BYTES, "é" * (DEFAULT_MAX_KEY_BYTES // 2)])
def test_build_intent_accepts_a_key_of_exactly_the_maximum(key: bytes | str) -> None:
    """A key exactly max_key_bytes long once encoded is accepted."""
    intent = build_intent("orders", b"v", key=key)
    assert intent.key is not None
    assert len(intent.key) == DEFAULT_MAX_KEY_BYTES


@pytest.mark.parametrize("key", [b"k" * (DEFAULT_MAX_KEY_BYTES + 1), "é" * 8193, b"k" * 10**7])
def test_build_intent_refuses_a_key_over_the_maximum(key: bytes | str) -> None:
    """A key over max_key_bytes raises KeyTooLarge (an InvalidKey) naming the size and limit."""
    with pytest.raises(KeyTooLarge, match=f"key is .* bytes .* maximum is {DEFAULT_MAX_KEY_BYTES}"):
        build_intent("orders", b"v", key=key)
    assert issubclass(KeyTooLarge, InvalidKey)


def test_the_key_limit_is_configurable() -> None:
    """Outbox(max_key_bytes=...) moves the key limit."""
    with pytest.raises(KeyTooLarge, match="maximum is 4"):
        Outbox(max_key_bytes=4).enqueue(object(), "orders", b"v", key="12345")


def test_a_header_takes_its_name_and_value_each_after_its_length() -> None:
    """As Kafka's record format stores a header: zigzag varint lengths, 1 byte below 64,
    2 below 8,192, 3 below 1,048,576."""
    assert header_bytes(b"a", b"") == 3
    assert header_bytes(b"n" * 63, b"v" * 64) == 1 + 63 + 2 + 64
    assert header_bytes(b"n" * 8191, b"v" * 8192) == 2 + 8191 + 3 + 8192


def test_build_intent_accepts_headers_of_exactly_the_maximum() -> None:
    """Headers taking exactly max_header_bytes in a Kafka record are accepted."""
    headers: list[tuple[str, bytes | str]] = [
        ("a", b"x" * 99),  # 1 + 1 + 2 + 99
        ("b", "é" * 4000),  # 1 + 1 + 2 + 8,000
    ]
    used = 103 + 8004
    headers.append(("c", b"y" * (DEFAULT_MAX_HEADER_BYTES - used - 1 - 1 - 3)))  # 8,272 bytes
    intent = build_intent("orders", b"v", headers=headers)
    size = sum(
        header_bytes(n.encode(), v)
        for n, v in zip(intent.header_names, intent.header_values, strict=True)
    )
    assert size == DEFAULT_MAX_HEADER_BYTES


@pytest.mark.parametrize(
    "headers",
    [
        {"big": b"x" * DEFAULT_MAX_HEADER_BYTES},
        {"n" * (DEFAULT_MAX_HEADER_BYTES + 1): b""},
        [(f"h{i}", b"x" * 1000) for i in range(17)],
        [("h", "é" * (DEFAULT_MAX_HEADER_BYTES // 2))],
        # Names and values of 16,384 bytes, but three times that in a record: a
        # broker with the default message.max.bytes refuses it.
        [("a", b"")] * DEFAULT_MAX_HEADER_BYTES,
        [("h", b"x" * (DEFAULT_MAX_HEADER_BYTES - 1 - 1 - 2))],  # one byte over with lengths
    ],
    ids=["one-value", "one-name", "many", "utf8-counts-bytes", "tiny-ones", "lengths-count"],
)
def test_build_intent_refuses_headers_over_the_maximum(headers: Any) -> None:
    """Names plus values over max_header_bytes raise HeadersTooLarge (an InvalidHeaders)."""
    with pytest.raises(HeadersTooLarge, match=f"maximum is {DEFAULT_MAX_HEADER_BYTES}"):
        build_intent("orders", b"v", headers=headers)
    assert issubclass(HeadersTooLarge, InvalidHeaders)


def test_the_header_limit_is_configurable() -> None:
    """Outbox(max_header_bytes=...) moves the header limit."""
    with pytest.raises(
        HeadersTooLarge, match=r"at least 11 bytes .*; the configured maximum is 8$"
    ):
        Outbox(max_header_bytes=8).enqueue(object(), "orders", b"v", headers={"abcd": "efghi"})


def test_build_intent_accepts_an_idempotency_key_of_exactly_the_maximum() -> None:
    """An idempotency key of exactly 1,024 UTF-8 bytes is accepted."""
    key = "é" * (MAX_IDEMPOTENCY_KEY_BYTES // 2)
    assert build_intent("orders", b"v", idempotency_key=key).idempotency_key == key


@pytest.mark.parametrize(
    "idempotency_key",
    ["k" * (MAX_IDEMPOTENCY_KEY_BYTES + 1), "é" * 513, "k" * 3000],
)
def test_build_intent_refuses_an_idempotency_key_over_the_maximum(idempotency_key: str) -> None:
    """An idempotency key over 1,024 UTF-8 bytes raises InvalidIdempotencyKey naming the limit,
    without echoing the whole key."""
    with pytest.raises(InvalidIdempotencyKey, match="at most 1024") as caught:
        build_intent("orders", b"v", idempotency_key=idempotency_key)
    assert len(str(caught.value)) < 300


# --- text PostgreSQL cannot store, text UTF-8 cannot encode, JSON too deep ---------------------

LONE = "\ud800"


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"topic": "or\x00ders"}, InvalidTopic, "topic"),
        ({"topic": f"or{LONE}ders"}, InvalidTopic, "topic"),
        ({"key": f"k{LONE}"}, InvalidKey, "key"),
        ({"value": f"v{LONE}"}, InvalidValue, "value"),
        ({"value": {"a": f"v{LONE}"}}, InvalidValue, "value"),
        ({"headers": {"na\x00me": b"v"}}, InvalidHeaders, "header name"),
        ({"headers": {f"na{LONE}me": b"v"}}, InvalidHeaders, "header name"),
        ({"headers": {"name": f"v{LONE}"}}, InvalidHeaders, "header 'name'"),
        ({"idempotency_key": "order\x0042"}, InvalidIdempotencyKey, "idempotency_key"),
        ({"idempotency_key": f"order{LONE}"}, InvalidIdempotencyKey, "idempotency_key"),
    ],
)
def test_build_intent_refuses_text_postgresql_or_utf8_cannot_hold(
    kwargs: dict[str, Any], error: type[InvalidMessage], names: str
) -> None:
    """NUL in a text field and unpaired surrogates anywhere raise the field's InvalidMessage
    subclass, naming the field, instead of a driver or codec error."""
    arguments: dict[str, Any] = {"topic": "orders", "value": b"v", **kwargs}
    topic, value = arguments.pop("topic"), arguments.pop("value")
    with pytest.raises(error) as caught:
        build_intent(topic, value, **arguments)
    assert names in str(caught.value)
    assert not isinstance(caught.value, UnicodeError)


def test_a_key_with_nul_is_kept_byte_for_byte() -> None:
    """A key is bytea: NUL is a byte like any other, in bytes or in str."""
    assert build_intent("orders", b"v", key="a\x00b").key == b"a\x00b"
    assert build_intent("orders", b"v", key=b"a\x00b").key == b"a\x00b"


def test_build_intent_refuses_json_that_nests_too_deeply() -> None:
    """A value nested deeper than json can encode raises InvalidValue, not RecursionError."""
    value: Any = []
    for _ in range(100_000):
        value = [value]
    with pytest.raises(InvalidValue, match="nests too deeply"):
        build_intent("orders", value)


# --- SQLAlchemy sessions without a default bind -------------------------------------------------

_ORDERS = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
#: Never connected to: the error comes before any connection is opened.
_NOWHERE = "postgresql+psycopg://127.0.0.1:1/none"


def test_a_session_without_a_default_bind_names_the_connection_to_pass() -> None:
    """Its tables may live in several databases: the error says which connection to give."""
    session = Session(binds={_ORDERS: sa.create_engine(_NOWHERE)})
    with pytest.raises(ConnectionNotSupported, match=r"no default bind.*bind_arguments"):
        outbox.enqueue(session, "orders", b"x")


def test_an_async_session_without_a_default_bind_names_the_connection_to_pass() -> None:
    """The same for an AsyncSession."""
    session = AsyncSession(binds={_ORDERS: create_async_engine(_NOWHERE)})
    with pytest.raises(ConnectionNotSupported, match=r"no default bind.*bind_arguments"):
        asyncio.run(outbox.aio.enqueue(session, "orders", b"x"))
