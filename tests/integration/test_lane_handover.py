"""A publisher that starts gets its share of the lanes within seconds, not heartbeats."""

from __future__ import annotations

import uuid

import pytest

from publisher.heartbeat import Heartbeat
from publisher.lanes import LaneKeeper
from publisher.store import PublisherStore
from tests.support import fetch_rows, wait_until

pytestmark = pytest.mark.integration

LANES = 32


def _heartbeat(database_url: str) -> tuple[PublisherStore, Heartbeat]:
    store = PublisherStore(database_url, uuid.uuid4())
    store.register("test", 0)
    # A heartbeat interval far longer than the handover may take.
    beat = Heartbeat(
        store,
        interval=30,
        lease_seconds=60,
        progressing=lambda: True,
        lanes=LaneKeeper(store, 60),
    )
    beat.beat()
    beat.start()
    return store, beat


def _owned(database_url: str, store: PublisherStore) -> int:
    [(count,)] = fetch_rows(
        database_url, "SELECT count(*) FROM outbox.lanes WHERE owner = %s", store.publisher_id
    )
    return int(count)


def test_the_first_publisher_gives_half_its_lanes_to_a_second_within_seconds(
    database_url: str,
) -> None:
    """With 30 s heartbeats, lanes still move within a few seconds of the second start."""
    first, first_beat = _heartbeat(database_url)
    second_beat = None
    try:
        assert _owned(database_url, first) == LANES
        second, second_beat = _heartbeat(database_url)
        wait_until(
            lambda: _owned(database_url, second) == LANES // 2,
            timeout=8,
            what="the second publisher to own half the lanes",
        )
        assert _owned(database_url, first) == LANES // 2
    finally:
        if second_beat is not None:
            second_beat.stop()
        first_beat.stop()
