"""outbox inspect tells a delivery sent in a Kafka transaction with its session."""

from __future__ import annotations

import json

import psycopg
import pytest

import outbox
from tests.support import publish_until_idle, run_outbox_cli

pytestmark = pytest.mark.integration


def test_a_transactional_delivery_is_an_attempt_with_its_transaction(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """No attempt row was written; inspect shows attempt 1 from the batch, with its session."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, b"v", key="k")
    totals = publish_until_idle(database_url, kafka_bootstrap, delivery="transactional")
    assert totals.delivered == 1
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.attempts").fetchone() == (0,)

    result = run_outbox_cli(database_url, "inspect", str(message_id), "--json")
    assert result.returncode == 0, result.stderr
    story = json.loads(result.stdout)
    [attempt] = story["attempts"]
    assert attempt["outcome"] == "delivered"
    assert (attempt["attempt"], attempt["fence"]) == (1, 1)
    assert attempt["transactional_id"].startswith("outbox-")
    claimed = next(e for e in story["timeline"] if e["event"] == "attempt 1 claimed")
    assert claimed["transaction"] == attempt["transactional_id"]
    assert claimed["batch"] == attempt["batch_id"]
