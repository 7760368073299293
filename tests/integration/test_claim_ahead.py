"""Claims made ahead of time look at the oldest pending messages only; others look at all."""

from __future__ import annotations

import psycopg
import pytest

import outbox
from tests.support import claiming_store

pytestmark = pytest.mark.integration


def test_a_bounded_claim_gives_up_where_an_unbounded_one_finds_a_free_key(
    database_url: str,
) -> None:
    """Behind a key in flight, a claim with a horizon of 3 finds nothing; without, the free key."""
    with psycopg.connect(database_url) as conn:
        held = outbox.enqueue_many(conn, [outbox.Message("t", b"a", key="a") for _ in range(5)])
        [free] = outbox.enqueue_many(conn, [outbox.Message("t", b"b", key="b")])
    store = claiming_store(database_url)
    try:
        first = store.claim(1, lease_seconds=30)
        assert first is not None
        assert [m.id for m in first.messages] == [held[0]]
        # The next three pending messages all wait behind the one in flight.
        assert store.claim(10, lease_seconds=30, horizon=3) is None
        later = store.claim(10, lease_seconds=30)
        assert later is not None
        assert [m.id for m in later.messages] == [free]
    finally:
        store.close()


def test_a_horizon_wide_enough_reaches_the_free_key(database_url: str) -> None:
    """The horizon counts pending messages in order: one that covers the free key claims it."""
    with psycopg.connect(database_url) as conn:
        held = outbox.enqueue_many(conn, [outbox.Message("t", b"a", key="a") for _ in range(3)])
        [free] = outbox.enqueue_many(conn, [outbox.Message("t", b"b", key="b")])
    store = claiming_store(database_url)
    try:
        first = store.claim(1, lease_seconds=30)
        assert first is not None
        assert [m.id for m in first.messages] == [held[0]]
        ahead = store.claim(10, lease_seconds=30, horizon=3)
        assert ahead is not None
        assert [m.id for m in ahead.messages] == [free]
    finally:
        store.close()
