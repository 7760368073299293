"""A publisher that starts gets its share of the lanes within seconds, not heartbeats."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from publisher.heartbeat import Heartbeat
from publisher.lanes import LaneKeeper
from publisher.store import PublisherStore
from tests.support import fetch_rows, wait_until

pytestmark = pytest.mark.integration

LANES = 32


def _heartbeat(
    database_url: str,
    *,
    interval: float = 30,
    lease_seconds: float = 60,
    loop_alive: Callable[[], bool] = lambda: True,
) -> tuple[PublisherStore, Heartbeat]:
    store = PublisherStore(database_url, uuid.uuid4())
    store.register("test", 0)
    # By default a heartbeat interval far longer than the handover may take.
    beat = Heartbeat(
        store,
        interval=interval,
        lease_seconds=lease_seconds,
        progressing=lambda: True,
        lanes=LaneKeeper(store, lease_seconds),
        loop_alive=loop_alive,
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


def test_a_publisher_whose_loop_stopped_turning_lets_its_lanes_go_to_the_others(
    database_url: str,
) -> None:
    """It stops beating and renewing lanes: they expire and move; they come back after."""
    alive = [True]
    stuck, stuck_beat = _heartbeat(
        database_url, interval=1, lease_seconds=3, loop_alive=lambda: alive[0]
    )
    other_beat = None
    try:
        other, other_beat = _heartbeat(database_url, interval=1, lease_seconds=3)
        wait_until(
            lambda: _owned(database_url, other) == LANES // 2,
            timeout=8,
            what="the lanes to be shared",
        )
        alive[0] = False
        wait_until(
            lambda: _owned(database_url, other) == LANES,
            timeout=15,
            what="the stuck publisher's lanes to move to the other one",
        )
        assert _owned(database_url, stuck) == 0
        alive[0] = True  # it turns again: it takes its share back
        wait_until(
            lambda: _owned(database_url, stuck) == LANES // 2,
            timeout=15,
            what="the recovered publisher to take its share again",
        )
    finally:
        if other_beat is not None:
            other_beat.stop()
        stuck_beat.stop()
