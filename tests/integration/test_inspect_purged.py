"""outbox inspect of a purged message finds its delivering batch without reading the table.

A delivery writes no attempt row, so once retention deleted a message its
delivery is told from the batch that claimed it. That batch is searched from
when the message was made (its UUIDv7 id) or after its last attempt, and the
search is stopped after a timeout: batches are kept for the evidence window,
and an operator's question must not read all of them.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import outbox
from outbox import render
from outbox.ids import new_message_id
from outbox.inspection import DeliverySearchStopped, read_timeline
from tests.support import fetch_rows, publish_until_idle, small_topic

pytestmark = pytest.mark.integration

OLD_BATCHES = 5_000


def _add_old_batches(url: str) -> None:
    """Settled batches claimed ten days ago, of other messages: what the evidence window keeps."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO outbox.batches (publisher_id, claimed_at, settled_at, message_ids) "
            "SELECT gen_random_uuid(), now() - interval '10 days' + i * interval '1 second', "
            "now() - interval '10 days' + i * interval '1 second', ARRAY[gen_random_uuid()] "
            "FROM generate_series(1, %s) AS i",
            (OLD_BATCHES,),
        )


def _batch_rows_read(conn: psycopg.Connection[Any]) -> int:
    """Rows of outbox.batches this transaction has read, by any scan."""
    row = conn.execute(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
        "FROM pg_stat_xact_user_tables WHERE relid = 'outbox.batches'::regclass"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_purged_delivery_is_found_without_reading_older_batches(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Ten days of older batches stay unread: the search starts where the message was made."""
    _add_old_batches(database_url)
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, b"v", key="k")
    assert publish_until_idle(database_url, kafka_bootstrap).delivered == 1
    [(batch_id,)] = fetch_rows(
        database_url, "SELECT batch_id FROM outbox.messages WHERE id = %s", message_id
    )
    with psycopg.connect(database_url) as conn:
        # Gone, as retention deletes a delivered message after its window.
        conn.execute("DELETE FROM outbox.messages WHERE id = %s", (message_id,))

    with psycopg.connect(database_url) as conn:
        timeline = read_timeline(conn, message_id)
        read = _batch_rows_read(conn)
    assert timeline is not None
    assert timeline.state == "purged"
    [delivery] = timeline.attempts
    assert (delivery["outcome"], delivery["attempt"], delivery["batch_id"]) == (
        "delivered",
        1,
        batch_id,
    )
    assert timeline.notes == ()
    # A bisection of the primary key (a probe per halving) and the search
    # from there: nowhere near the older batches.
    assert read < 100, f"read {read} rows of outbox.batches, of {OLD_BATCHES + 1}"


def test_an_id_that_is_no_message_id_reads_no_batch(database_url: str) -> None:
    """Message ids are UUIDv7: a UUID of another version names no message, and no batch is read."""
    _add_old_batches(database_url)
    with psycopg.connect(database_url) as conn:
        assert read_timeline(conn, uuid.uuid4()) is None
        assert _batch_rows_read(conn) == 0


def test_a_search_that_takes_too_long_is_stopped_and_says_so(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """With nothing else known the search's end is an error that says so; with an attempt
    known, the timeline is shown with a note. The caller's transaction is left as it was."""
    small = small_topic(kafka_bootstrap)
    with psycopg.connect(database_url) as conn:
        delivered = outbox.enqueue(conn, topic, b"v")
        refused = outbox.enqueue(conn, small, b"x" * 5000)  # over the topic's size: quarantined
    never_enqueued = new_message_id()
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert (totals.delivered, totals.quarantined) == (1, 1)
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM outbox.messages WHERE id = ANY(%s)", ([delivered, refused],))
        # Many later claims of other messages, more than a millisecond's reading.
        conn.execute(
            "INSERT INTO outbox.batches (publisher_id, settled_at, message_ids) "
            "SELECT gen_random_uuid(), now(), ARRAY[gen_random_uuid()] "
            "FROM generate_series(1, 100000)"
        )
    too_short = timedelta(milliseconds=1)

    with psycopg.connect(database_url) as conn:
        with pytest.raises(DeliverySearchStopped) as stopped:
            read_timeline(conn, never_enqueued, search_timeout=too_short)
        assert f"no message {never_enqueued}, and no attempt or decision of one" in str(
            stopped.value
        )
        assert "stopped after 0.001s" in str(stopped.value)

        timeline = read_timeline(conn, refused, search_timeout=too_short)
        assert timeline is not None
        assert [a["outcome"] for a in timeline.attempts] == ["failed"]
        [note] = timeline.notes
        assert note.startswith("the search of outbox.batches for its delivery was stopped")
        assert f"(note: {note})" in render.timeline_text(timeline)

        # The caller's transaction goes on, with its own statement timeout.
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        found = read_timeline(conn, delivered)
    assert found is not None
    assert [a["outcome"] for a in found.attempts] == ["delivered"]
