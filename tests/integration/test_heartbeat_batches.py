"""The heartbeat renews only the leases of the batches the loop still works on."""

from __future__ import annotations

import psycopg
import pytest

import outbox
from tests.support import claiming_store, fetch_rows

pytestmark = pytest.mark.integration


def test_only_the_named_batches_are_renewed(database_url: str) -> None:
    """A batch the loop let go of (or never heard of) keeps its lease and expires."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message("t", b"v", key=f"k{i}") for i in range(4)])
    store = claiming_store(database_url)
    try:
        held = store.claim(2, lease_seconds=10)
        orphan = store.claim(2, lease_seconds=10)
        assert held is not None
        assert orphan is not None
        renewed = store.heartbeat(60, renew=True, batches=[held.id])
        assert renewed == 1  # one lease: the batch's
    finally:
        store.close()
    leases = dict(
        fetch_rows(
            database_url,
            "SELECT id, lease_expires_at - now() > interval '30 seconds' FROM outbox.batches",
        )
    )
    assert leases == {held.id: True, orphan.id: False}
