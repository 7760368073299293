"""examples/fastapi_service.py, served by uvicorn on loopback and driven over HTTP."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
import uvicorn
from fastapi import FastAPI

from tests.support import publish_until_idle, read_topic, wait_until

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextmanager
def _served(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port; yield its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            wait_until(lambda: server.started or not thread.is_alive(), timeout=10, what="uvicorn")
            assert server.started, "uvicorn did not start"
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
        assert not thread.is_alive(), "uvicorn did not stop"


def test_an_order_and_its_event_commit_together_and_a_refused_order_enqueues_nothing(
    database_url: str, kafka_bootstrap: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placed order's event reaches Kafka; the refused and the invalid ones leave nothing."""
    monkeypatch.syspath_prepend(EXAMPLES)  # as `uvicorn --app-dir examples` does
    from fastapi_service import create_app  # noqa: PLC0415 - from examples/, put on the path above

    order = {"customer": "customer-7", "reference": "r-1", "total": "42.50"}
    with _served(create_app(database_url, topic)) as url, httpx.Client(base_url=url) as client:
        placed = client.post("/orders", json=order)
        assert placed.status_code == 201, placed.text
        repeated = client.post("/orders", json={**order, "total": "1.00"})
        assert repeated.status_code == 409, repeated.text  # refused at commit, after enqueue
        invalid = client.post("/orders", json={**order, "reference": "r-2", "total": "-1"})
        assert invalid.status_code == 422, invalid.text
    order_id = placed.json()["order_id"]

    with psycopg.connect(database_url) as conn:
        orders = conn.execute("SELECT id::text, total FROM shop_orders").fetchall()
        messages = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
    assert [(oid, str(total)) for oid, total in orders] == [(order_id, "42.50")]
    assert messages == (1,)

    publish_until_idle(database_url, kafka_bootstrap)
    records = read_topic(kafka_bootstrap, topic)
    assert [(r.key, json.loads(r.value)) for r in records] == [
        (b"customer-7", {"type": "OrderPlaced", "order_id": order_id, "total": "42.50"})
    ]
