"""Message ids are UUIDv7 (RFC 9562), strictly increasing within a process (outbox/ids.py)."""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta

from outbox import ids
from outbox.ids import created_at, new_message_id


def test_new_message_id_is_a_uuid_version_7_with_the_rfc_9562_variant() -> None:
    """An id has version 7 in bits 48-51 and the RFC 9562 variant (0b10) in bits 64-65."""
    message_id = new_message_id()
    assert message_id.version == 7
    assert message_id.variant == uuid.RFC_4122  # RFC 9562 keeps RFC 4122's variant bits
    assert (message_id.int >> 76) & 0xF == 7
    assert (message_id.int >> 62) & 0b11 == 0b10


def test_consecutive_ids_are_strictly_increasing_and_unique() -> None:
    """20,000 ids made in a row sort in the order they were made, with no repeats."""
    ids = [new_message_id() for _ in range(20_000)]
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert len(set(ids)) == len(ids)
    assert all(i.version == 7 for i in ids)


def test_id_embeds_the_current_unix_time_in_milliseconds() -> None:
    """The top 48 bits of an id are a Unix millisecond timestamp within a second of now."""
    before = time.time()
    message_id = new_message_id()
    after = time.time()
    embedded_ms = message_id.int >> 80
    assert before * 1000 - 1000 <= embedded_ms <= after * 1000 + 1000


def test_created_at_reads_the_time_back_and_refuses_other_versions() -> None:
    """An id's creation time is its first 48 bits; a UUID of another version has none."""
    before = datetime.now(UTC) - timedelta(milliseconds=1)
    made = created_at(new_message_id())
    assert made is not None
    assert before <= made <= datetime.now(UTC)
    ms = 1_700_000_000_123  # 2023-11-14 22:13:20.123 UTC
    assert created_at(uuid.UUID(f"{ms:012x}70008000000000000000")) == datetime(
        2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC
    )
    assert created_at(uuid.uuid4()) is None


def test_a_forked_child_makes_ids_while_a_parent_thread_held_the_lock() -> None:
    """A fork while another thread holds the id lock would leave the child's copy locked
    for ever: the child gets a fresh lock."""
    with ids._lock:  # as another thread of the parent might be, at the fork
        pid = os.fork()
        if pid == 0:  # the child: makes an id, or hangs
            new_message_id()
            os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the child hung making an id")
