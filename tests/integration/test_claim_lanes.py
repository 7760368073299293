"""A claim reads its own lanes only, however many messages wait in other lanes.

Pending messages are indexed by lane, then seq (messages_pending_by_lane),
and the claim merges its lanes in seq order. These tests put a backlog in a
lane another publisher owns, older than the messages of this publisher's
lanes, and check what the claim takes and how many rows its plan reads:
walking every pending message in seq order, as claims once did, reads the
whole backlog at every claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox.queries import query
from publisher.store import LANES
from tests.support import ClaimingStore, claim_rows_read, claiming_store, plan_rows_read

pytestmark = pytest.mark.integration

BACKLOG = 5_000
TOPIC = "orders"


def _lane_of(conn: psycopg.Connection[Any], message_id: uuid.UUID) -> int:
    [(lane,)] = conn.execute(
        "SELECT lane FROM outbox.messages WHERE id = %s", (message_id,)
    ).fetchall()
    return int(lane)


def _give_lane_away(database_url: str, lane: int) -> None:
    """Another publisher holds ``lane``, its lease live."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.lanes SET owner = %s, lease_expires_at = now() + interval '1 hour', "
            "fence = fence + 1 WHERE lane = %s",
            (uuid.uuid4(), lane),
        )


@pytest.fixture(params=["fresh", "stale"], ids=["statistics-fresh", "statistics-stale"])
def other_lane_backlog(
    database_url: str, request: pytest.FixtureRequest
) -> Iterator[tuple[ClaimingStore, set[uuid.UUID]]]:
    """BACKLOG messages of one key in a lane another publisher owns, then ten of this one's.

    Yields this publisher's store (owning every other lane) and the ids of the ten.
    The statistics are taken after the messages are written, or (stale) before,
    with nothing pending, as a queue table's usually are when a backlog builds.
    """
    stale = request.param == "stale"
    store = claiming_store(database_url)
    try:
        if stale:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("ALTER TABLE outbox.messages SET (autovacuum_enabled = false)")
                conn.execute("ANALYZE outbox.messages")
        with psycopg.connect(database_url) as conn:
            outbox.enqueue_many(
                conn, [outbox.Message(TOPIC, b"busy", key="hot") for _ in range(BACKLOG)]
            )
            busy = _lane_of(conn, outbox.enqueue(conn, TOPIC, b"busy", key="hot"))
        mine: set[uuid.UUID] = set()
        with psycopg.connect(database_url) as conn:
            i = 0
            while len(mine) < 10:
                message_id = outbox.enqueue(conn, TOPIC, b"mine", key=f"k{i}")
                if _lane_of(conn, message_id) == busy:
                    conn.execute("DELETE FROM outbox.messages WHERE id = %s", (message_id,))
                else:
                    mine.add(message_id)
                i += 1
        if not stale:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("ANALYZE outbox.messages")
        _give_lane_away(database_url, busy)
        yield store, mine
    finally:
        store.close()


def test_a_claim_takes_its_lanes_messages_past_another_lanes_backlog(
    other_lane_backlog: tuple[ClaimingStore, set[uuid.UUID]],
) -> None:
    """The ten messages of this publisher's lanes, and none of the busy lane."""
    store, mine = other_lane_backlog
    batch = store.claim(500, 30.0)
    assert batch is not None
    assert {m.id for m in batch.messages} == mine
    assert store.claim(500, 30.0) is None, "a message of another publisher's lane was claimed"


@pytest.mark.parametrize("ahead", [False, True], ids=["claim", "claim-ahead"])
def test_a_claim_does_not_read_another_lanes_backlog(
    other_lane_backlog: tuple[ClaimingStore, set[uuid.UUID]], ahead: bool
) -> None:
    """A few rows per lane at most, where walking every pending message reads 5,000 more."""
    store, _ = other_lane_backlog
    read = claim_rows_read(store, ahead=ahead)
    assert read < 10 * LANES, f"the claim read {read} rows of outbox.messages"


def test_an_empty_claim_does_not_read_another_lanes_backlog(
    other_lane_backlog: tuple[ClaimingStore, set[uuid.UUID]],
) -> None:
    """With nothing left in its own lanes, a claim reads next to nothing."""
    store, _ = other_lane_backlog
    assert store.claim(500, 30.0) is not None  # takes the ten
    # The ten, in flight, are still pending: read and skipped.
    read = claim_rows_read(store, ahead=False)
    assert read < 10 * LANES, f"the claim read {read} rows of outbox.messages"


def test_when_its_lanes_are_empty_the_publisher_is_due_at_its_own_work_only(
    other_lane_backlog: tuple[ClaimingStore, set[uuid.UUID]],
) -> None:
    """After an empty claim: due when its batch's lease expires, not at once for the
    other lane's backlog, which it cannot claim; and that backlog is not read."""
    store, _ = other_lane_backlog
    assert store.claim(500, 30.0) is not None  # takes the ten, for 30 s
    due = store.seconds_until_due()
    assert due is not None
    assert 25 < due <= 30, due
    lanes = [
        lane for (lane,) in store.conn.execute(query("owned_lanes"), {"owner": store.publisher_id})
    ]
    assert len(lanes) == LANES - 1
    with store.conn.transaction():
        [(plan,)] = store.conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + query("seconds_until_due"), {"lanes": lanes}
        ).fetchall()
    read = plan_rows_read(plan[0]["Plan"])
    assert read < 10 * LANES, f"seconds_until_due read {read} rows of outbox.messages"


def test_the_store_plans_its_claim_once(database_url: str) -> None:
    """Prepared without parameters: one plan at the first run, reused by every later one.

    A parameter would make PostgreSQL plan each of the first five runs anew
    (custom plans), 10 to 25 ms each for the claim's branches.
    """
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message(TOPIC, b"v") for _ in range(8)])
    store = claiming_store(database_url)
    try:
        for _ in range(8):
            assert store.claim(1, 30.0) is not None
        for _ in range(2):
            assert store.claim(1, 30.0, horizon=2) is None
        # The store prepares nothing but its claims.
        plans = store.conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "ORDER BY generic_plans DESC"
        ).fetchall()
    finally:
        store.close()
    assert plans == [(8, 0), (2, 0)]


def test_the_claim_merges_as_many_lanes_as_the_schema_has(database_url: str) -> None:
    """LANES (the claim's branches) is the number of lanes of outbox.lanes and of messages."""
    with psycopg.connect(database_url) as conn:
        [(count, low, high)] = conn.execute(
            "SELECT count(*), min(lane), max(lane) FROM outbox.lanes"
        ).fetchall()
        outbox.enqueue_many(conn, [outbox.Message(TOPIC, b"v") for _ in range(2_000)])
        [(used, lowest, highest)] = conn.execute(
            "SELECT count(DISTINCT lane), min(lane), max(lane) FROM outbox.messages"
        ).fetchall()
        conn.rollback()
    assert (count, low, high) == (LANES, 0, LANES - 1)
    assert (used, lowest, highest) == (LANES, 0, LANES - 1)


def test_messages_in_flight_at_the_head_of_a_lane_do_not_hide_the_next(
    database_url: str,
) -> None:
    """Claims of one: unkeyed messages of one lane, each claimed while the earlier are in flight.

    Each branch stops at the claim's limit, so what is in flight has to be
    tested in the branch: tested after the merge, the message in flight
    filled the branch and the claim found nothing.
    """
    with psycopg.connect(database_url) as conn:
        first = outbox.enqueue(conn, TOPIC, b"0")
        lane = _lane_of(conn, first)
        same = [first]
        while len(same) < 3:
            message_id = outbox.enqueue(conn, TOPIC, b"%d" % len(same))
            if _lane_of(conn, message_id) == lane:
                same.append(message_id)
            else:
                conn.execute("DELETE FROM outbox.messages WHERE id = %s", (message_id,))
    store = claiming_store(database_url)
    try:
        for ahead in (None, 2):
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("DELETE FROM outbox.batches")
            claimed: list[uuid.UUID] = []
            for _ in same:
                batch = store.claim(1, 30.0, horizon=ahead)
                assert batch is not None, f"found nothing after {claimed} (horizon {ahead})"
                claimed.extend(m.id for m in batch.messages)
            assert claimed == same
    finally:
        store.close()
