"""The HTTP endpoints (publisher/endpoints.py), served on a loopback port of their own."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from publisher.endpoints import EndpointServer
from publisher.health import Health
from publisher.metrics import PublisherMetrics


def _get(url: str) -> tuple[int, str, str]:
    """Status, content type and body of a GET, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a loopback URL
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[str, Health, PublisherMetrics, EndpointServer]]:
    """A server for one publisher's metrics and health on 127.0.0.1, a free port."""
    health = Health(stall_seconds=50, alive_seconds=110)
    metrics = PublisherMetrics(health)
    server = EndpointServer("127.0.0.1", 0, metrics.registry, health)
    server.start()
    host, port = server.address
    try:
        yield f"http://{host}:{port}", health, metrics, server
    finally:
        server.stop()


def test_metrics_are_served_in_the_prometheus_text_format(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """/metrics answers 200 with the registry's samples, parseable as Prometheus text."""
    base, _, metrics, _ = served
    metrics.deliveries.labels("orders").inc(4)
    status, content_type, body = _get(base + "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("outbox_deliveries_total", (("topic", "orders"),))] == 4
    assert samples[("outbox_ready", ())] == 0


def test_readyz_is_503_with_the_failing_checks_until_ready_then_200(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """/readyz names what is not ready in JSON; once everything is, it answers 200."""
    base, health, _, _ = served
    status, content_type, body = _get(base + "/readyz")
    assert (status, content_type) == (503, "application/json")
    answer = json.loads(body)
    assert answer["ok"] is False
    assert answer["failing"] == ["registered", "database", "kafka", "loop"]

    health.registered = True
    health.database.succeeded()
    health.kafka.failed("KafkaConnectionError: 111 ECONNREFUSED")
    health.loop_started()
    status, _, body = _get(base + "/readyz")
    assert status == 503
    assert json.loads(body)["failing"] == ["kafka"]
    assert "ECONNREFUSED" in json.loads(body)["checks"]["kafka"]

    health.kafka.succeeded()
    status, _, body = _get(base + "/readyz")
    assert status == 200
    assert json.loads(body) == {
        "ok": True,
        "failing": [],
        "checks": {"registered": "ok", "database": "ok", "kafka": "ok", "loop": "ok"},
    }


def test_healthz_is_200_while_the_loop_lives_and_503_once_it_ended(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """/healthz follows the loop: alive while starting and running, 503 after it ended."""
    base, health, _, _ = served
    assert _get(base + "/healthz")[0] == 200
    health.loop_started()
    assert _get(base + "/healthz")[0] == 200
    health.loop_ended()
    status, _, body = _get(base + "/healthz")
    assert status == 503
    assert json.loads(body)["checks"] == {"loop": "the loop has ended"}


@pytest.mark.parametrize("path", ["/", "/metricsx", "/readyz/extra", "/favicon.ico"])
def test_other_paths_are_404(
    served: tuple[str, Health, PublisherMetrics, EndpointServer], path: str
) -> None:
    """Only the three endpoints exist."""
    assert _get(served[0] + path)[0] == 404


def test_stop_closes_the_socket(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """After stop() nothing listens on the port any more."""
    _, _, _, server = served
    host, port = server.address
    server.stop()
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), timeout=5):
        pass


def test_an_address_in_use_fails_at_construction() -> None:
    """Binding happens in the constructor, so a taken port is an OSError at start."""
    health = Health(stall_seconds=50, alive_seconds=110)
    first = EndpointServer("127.0.0.1", 0, PublisherMetrics().registry, health)
    try:
        with pytest.raises(OSError, match="in use"):
            EndpointServer("127.0.0.1", first.address[1], PublisherMetrics().registry, health)
    finally:
        first.stop()


def test_one_turn_serves_one_waiting_request_without_a_thread() -> None:
    """run_once answers a request already waiting on the socket; no serving thread is started."""
    health = Health(stall_seconds=50, alive_seconds=110)
    server = EndpointServer("127.0.0.1", 0, PublisherMetrics(health).registry, health)
    try:
        with socket.create_connection(server.address, timeout=5) as client:
            client.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            server.run_once()
            response = client.makefile("rb").read()
        assert not server.running
    finally:
        server.stop()
    assert response.startswith(b"HTTP/1.0 200 ")
    assert response.endswith(b'"checks": {"loop": "ok"}}\n')
