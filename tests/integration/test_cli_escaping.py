"""The ``outbox`` command's tables never pass a control character from the database through.

A message's key and header names are chosen by whoever enqueues, and its
error text comes from Kafka or an operator: printed raw, a key such as
``ESC [2J`` would clear the operator's screen. ``status``, ``list`` and
``inspect`` print them escaped (``outbox.render.printable``).
"""

from __future__ import annotations

import unicodedata

import psycopg
import pytest

import outbox
from tests.support import run_outbox_cli

pytestmark = pytest.mark.integration

#: Clear the screen, ring the bell, start a fake line, set the window title, a C1 CSI.
HOSTILE = "\x1b[2J\x07\nFAKE LINE\x1b]0;pwned\x07\x9b31m"


def _controls(text: str) -> list[str]:
    """Control characters other than the newlines that end the command's own lines."""
    return [c for c in text if unicodedata.category(c) == "Cc" and c != "\n"]


def test_status_list_and_inspect_print_hostile_fields_escaped(database_url: str) -> None:
    """A hostile key, header name and error show escaped on the line they belong to."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(
            conn, "orders", b"v", key=HOSTILE, headers={"trace" + HOSTILE: b"x"}
        )
        outbox.enqueue(conn, "orders", b"behind", key=HOSTILE)  # its key is held
        conn.execute(
            "UPDATE outbox.messages SET state = 'quarantined', attempts = 1, last_error = %s "
            "WHERE id = %s",
            ("InvalidRecord: " + HOSTILE, message_id),
        )

    for args in (
        ("status",),
        ("list", "--state", "quarantined"),
        ("inspect", str(message_id)),
    ):
        result = run_outbox_cli(database_url, *args)
        assert result.returncode in (0, 1), result.stderr
        assert _controls(result.stdout) == [], args
        assert "\\x1b[2J\\x07\\nFAKE LINE" in result.stdout, args
        assert not any(line.startswith("FAKE LINE") for line in result.stdout.splitlines())

    inspected = run_outbox_cli(database_url, "inspect", str(message_id)).stdout
    assert "headers:         trace\\x1b[2J" in inspected
    assert "last error:      InvalidRecord: \\x1b[2J" in inspected
