"""How the outbox command lays out what it shows (pure formatting, no database)."""

from __future__ import annotations

import json
import unicodedata
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from outbox.inspection import Event, Listing, Timeline
from outbox.render import (
    age,
    key_text,
    listing_json,
    listing_text,
    printable,
    status_text,
    table,
    timeline_json,
    timeline_text,
    to_json,
)
from outbox.status import HeldKey, StatusLine

#: Text a hostile producer could put in a key, a header name or an error: clear the screen,
#: move the cursor home and write there, ring the bell, start a line of its own, an OSC
#: window title, a C1 CSI, DEL, and a right-to-left override.
HOSTILE = "\x1b[2J\x1b[Hok\x07\nFAKE LINE\r\x1b]0;title\x07\x9b31m\x7f\u202eevil"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (-3, "0s"),
        (42.9, "42s"),
        (200, "3m 20s"),
        (5 * 3600 + 120, "5h 02m"),
        (2 * 86400 + 3 * 3600, "2d 03h"),
    ],
)
def test_ages_read_at_a_glance(seconds: float | None, shown: str) -> None:
    """Durations use the two largest units."""
    assert age(seconds) == shown


def test_keys_are_text_or_hex() -> None:
    """A UTF-8 key is shown as itself, anything else as 0x-prefixed hex."""
    assert key_text(b"order-7") == "order-7"
    assert key_text(b"\xff\x00") == "0xff00"
    assert key_text(None) is None


def test_json_turns_times_ids_and_bytes_into_text() -> None:
    """The JSON output never fails on the types the tables return."""
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    i = uuid.UUID(int=1)
    out = json.loads(to_json({"at": at, "id": i, "key": b"k", "rows": [(i, b"\xfe")]}))
    assert out == {
        "at": "2026-01-02T03:04:05+00:00",
        "id": str(i),
        "key": "k",
        "rows": [[str(i), "0xfe"]],
    }


def test_tables_align_columns_and_leave_the_last_one_ragged() -> None:
    """Cells are padded to the widest of their column; right-aligned ones on the left."""
    text = table([["STATE", "N", "NEXT"], ["pending", "12", "none"]], right=frozenset({1}))
    assert text.splitlines() == ["STATE     N  NEXT", "pending  12  none"]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[2J", "\\x1b[2J"),
        ("a\nb", "a\\nb"),
        ("\x07", "\\x07"),
        ("tab\there\r", "tab\\there\\r"),
        ("\x00\x7f\x85\x9b", "\\x00\\x7f\\x85\\x9b"),
        ("\u202eabc\u2066\u2028", "\\u202eabc\\u2066\\u2028"),
        ("back\\slash", "back\\\\slash"),
        ("order-7 Zürich 東京 🚚", "order-7 Zürich 東京 🚚"),
        (None, "-"),
        (uuid.UUID(int=5), str(uuid.UUID(int=5))),
    ],
)
def test_printable_escapes_control_characters_and_nothing_else(text: object, shown: str) -> None:
    """C0, DEL, C1, separators and bidi controls are escaped; letters of any script are kept."""
    assert printable(text) == shown


def test_printable_output_holds_no_control_character() -> None:
    """Every code point that moves the cursor, rings, or reorders text comes out escaped."""
    every = "".join(chr(c) for c in range(0x3000))
    out = printable(every)
    assert not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in out)
    assert not any(0x202A <= ord(c) <= 0x202E or 0x2066 <= ord(c) <= 0x2069 for c in out)


def _hostile_controls(text: str) -> list[str]:
    """The control characters in ``text`` other than the newlines between its own lines."""
    return [c for c in text if unicodedata.category(c) == "Cc" and c != "\n"]


def _status_line(topic: str | None, state: str, next_action: str) -> StatusLine:
    return StatusLine(
        topic, state, 1, None, 5.0, 0, 0, 1, 0, [], None, 0, 0, 0, 1, 1, False, next_action
    )


def test_status_text_escapes_topics_keys_and_reasons() -> None:
    """outbox status: a hostile key, topic and reason cannot add lines or escape sequences."""
    held = HeldKey("orders", HOSTILE.encode(), uuid.UUID(int=1), "quarantined", 2, HOSTILE, "x")
    lines = [_status_line(None, "quarantined", "retry"), _status_line(HOSTILE, "quarantined", "y")]
    text = status_text(lines, [held])
    assert _hostile_controls(text) == []
    assert "\\x1b[2J\\x1b[Hok\\x07\\nFAKE LINE" in text
    assert not any(line.startswith("FAKE LINE") for line in text.splitlines())
    assert "  orders / \\x1b[2J" in text


def test_status_of_a_topic_with_no_line_says_to_check_its_name() -> None:
    """--topic with a name no line has (a typo) says so, and whether the count was estimated."""
    lines = [_status_line(None, "pending", "none"), _status_line("orders", "pending", "none")]
    text = status_text(lines, [], topic="ordres")
    assert "no messages of this topic: check its name" in text
    estimated = [*lines, replace(_status_line(None, "delivered", "none"), exact=False)]
    text = status_text(estimated, [], topic="ordres")
    assert "no open messages of this topic, and none delivered that the estimate sees" in text
    assert status_text([], [], topic=None).endswith("ALL TOPICS\nno messages")


def test_a_key_that_is_not_utf8_shows_as_hex() -> None:
    """Bytes that do not decode are shown as hex, which holds nothing a terminal acts on."""
    held = HeldKey("orders", b"\xff\x1b[2J\x9b", uuid.UUID(int=1), "quarantined", 1, "r", "n")
    text = status_text([_status_line(None, "quarantined", "retry")], [held])
    assert "orders / 0xff1b5b324a9b:" in text
    assert _hostile_controls(text) == []


def _message(**overrides: object) -> dict[str, object]:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    message: dict[str, object] = {
        "id": uuid.UUID(int=9),
        "topic": "orders",
        "key": HOSTILE.encode(),
        "state": "quarantined",
        "created_at": at,
        "value_bytes": 3,
        "header_names": ["trace\x1b[31m", "ok"],
        "idempotency_key": HOSTILE,
        "lane": 1,
        "seq": 1,
        "attempts": 1,
        "failures": 1,
        "fence": 1,
        "kafka_partition": None,
        "kafka_offset": None,
        "available_at": at,
        "lease_owner": None,
        "lease_expires_at": None,
        "escalated_at": None,
        "last_error": "InvalidRecord: " + HOSTILE,
    }
    message.update(overrides)
    return message


def test_inspect_text_escapes_every_field_and_timeline_detail() -> None:
    """outbox inspect: key, header names, idempotency key, error and event details escaped."""
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    timeline = Timeline(
        uuid.UUID(int=9),
        _message(),
        [],
        [],
        None,
        None,
        [
            Event(at, "attempt", {"error": HOSTILE, "by\x1b[2J": "x", "evidence": {"k": HOSTILE}}),
            Event(at, "decided\nFAKE", {"reason": "a\nb"}),
        ],
    )
    text = timeline_text(timeline)
    assert _hostile_controls(text) == []
    assert not any(line.startswith("FAKE") for line in text.splitlines())
    assert "headers:         trace\\x1b[31m, ok" in text
    assert "last error:      InvalidRecord: \\x1b[2J" in text
    assert "by\\x1b[2J=x" in text
    assert "decided\\nFAKE  reason=a\\nb" in text


def test_list_text_escapes_keys_and_errors() -> None:
    """outbox list: a hostile key and error stay on their row, escaped."""
    listing = Listing([_message(state="pending")], more=False)
    text = listing_text(listing, now=datetime(2026, 1, 2, 3, 5, 0, tzinfo=UTC))
    assert _hostile_controls(text) == []
    assert len(text.splitlines()) == 2  # the header and the one message
    assert "InvalidRecord: \\x1b[2J" in text


def test_json_output_escapes_by_being_json() -> None:
    """--json output holds no raw control character either, and reads back to the original."""
    listing = Listing([_message()], more=False)
    out = listing_json(listing)
    assert _hostile_controls(out) == []
    assert json.loads(out)["messages"][0]["key"] == HOSTILE
    timeline = Timeline(uuid.UUID(int=9), _message(), [], [], None, None, [])
    assert _hostile_controls(timeline_json(timeline)) == []


@pytest.mark.parametrize(
    ("state", "partition", "offset", "shown"),
    [
        ("uncertain", 1, None, "partition 1 offset not known"),
        ("delivered", 2, 17, "partition 2 offset 17"),
        ("delivered", None, None, "not recorded"),  # resolved --delivered without them
    ],
)
def test_a_location_is_said_as_far_as_the_row_knows_it(
    state: str, partition: int | None, offset: int | None, shown: str
) -> None:
    """inspect and list never print a Python None for an offset not known."""
    message = _message(state=state, kafka_partition=partition, kafka_offset=offset)
    timeline = Timeline(uuid.UUID(int=9), message, [], [], None, None, [])
    inspected = timeline_text(timeline)
    listed = listing_text(Listing([message], more=False), now=datetime(2026, 1, 3, tzinfo=UTC))
    assert "None" not in inspected
    assert "None" not in listed
    if partition is not None:
        assert f"location:        {shown}" in inspected
    if state == "delivered":
        assert shown in listed


@pytest.mark.parametrize("state", ["quarantined", "pending"])
def test_no_location_is_shown_for_a_message_whose_send_wrote_nothing(state: str) -> None:
    """A refused or failed send keeps the partition it aimed at; "partition 1 offset not
    known" would read as "written there or nowhere", which is what uncertain means."""
    message = _message(state=state, kafka_partition=1, kafka_offset=None)
    inspected = timeline_text(Timeline(uuid.UUID(int=9), message, [], [], None, None, []))
    assert "location:" not in inspected
    assert "partition 1" not in inspected
