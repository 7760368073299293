"""The HTTP endpoints (publisher/endpoints.py), served on a loopback port of their own."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from publisher.endpoints import MAX_REQUEST_BYTES, EndpointServer
from publisher.health import Health, KafkaClusterCheck
from publisher.metrics import PublisherMetrics, StatusCollector
from tests.support import wait_until


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
    """/readyz gives the code of what is not ready in JSON; once everything is, it answers 200."""
    base, health, _, _ = served
    status, content_type, body = _get(base + "/readyz")
    assert (status, content_type) == (503, "application/json")
    answer = json.loads(body)
    assert answer["ok"] is False
    assert answer["failing"] == ["registered", "database", "kafka", "loop"]

    health.registered = True
    health.database.succeeded()
    health.kafka.failed(ConnectionRefusedError(111, "ECONNREFUSED"))
    health.loop_started()
    status, _, body = _get(base + "/readyz")
    assert status == 503
    assert json.loads(body)["failing"] == ["kafka"]
    assert json.loads(body)["checks"]["kafka"] == "kafka_unavailable"
    assert "ECONNREFUSED" not in body

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
    assert json.loads(body)["checks"] == {"loop": "loop_ended"}


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


def _closed_port() -> int:
    """A loopback port nothing listens on (the kernel's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _closed_by_server(client: socket.socket) -> bool:
    """Whether the server closed ``client`` (end of file, or a reset); False while it is open."""
    client.setblocking(False)
    try:
        return client.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_readyz_gives_codes_and_no_word_of_what_the_dependencies_said(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """Real psycopg and Kafka failures show as codes: no host, port, user, database or message."""
    base, health, _, _ = served
    port = _closed_port()
    with pytest.raises(psycopg.OperationalError) as database_error:
        psycopg.connect(
            f"postgresql://ops_admin:hunter2@127.0.0.1:{port}/payments", connect_timeout=5
        )
    check = KafkaClusterCheck(f"localhost:{port}", timeout_ms=500)
    with pytest.raises(KafkaError) as kafka_error:
        check()
    check.close()
    health.registered = True
    health.loop_started()
    health.database.failed(database_error.value)
    health.kafka.failed(kafka_error.value)

    status, _, body = _get(base + "/readyz")

    assert status == 503
    assert json.loads(body) == {
        "ok": False,
        "failing": ["database", "kafka"],
        "checks": {
            "registered": "ok",
            "database": "database_unavailable",
            "kafka": "kafka_unavailable",
            "loop": "ok",
        },
    }
    assert str(port) in str(database_error.value)  # what would have leaked
    assert str(port) in str(kafka_error.value)
    for secret in (str(port), "127.0.0.1", "localhost", "ops_admin", "payments", "refused"):
        assert secret not in body


def test_idle_connections_do_not_keep_a_probe_waiting(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """200 connections held open, half of them mid-request, cost no thread: /healthz answers
    within a second, and the idle connections are still open (waiting, not refused)."""
    base, _, _, server = served
    threads = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for i in range(200):
            client = socket.create_connection(server.address, timeout=5)
            if i % 2:
                client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            idle.append(client)
        started = time.monotonic()
        status, _, _ = _get(base + "/healthz")
        elapsed = time.monotonic() - started
        assert status == 200
        assert elapsed < 1.0
        assert not any(_closed_by_server(client) for client in idle)
        assert threading.active_count() == threads
    finally:
        for client in idle:
            client.close()


def test_past_the_connection_limit_the_oldest_waiting_connection_is_closed() -> None:
    """With every slot taken by idle connections, a new request is answered; the oldest goes."""
    health = Health(stall_seconds=50, alive_seconds=110)
    server = EndpointServer(
        "127.0.0.1", 0, PublisherMetrics(health).registry, health, max_connections=8
    )
    server.start()
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(8)]
    try:
        host, port = server.address
        assert _get(f"http://{host}:{port}/healthz")[0] == 200
        wait_until(lambda: _closed_by_server(idle[0]), timeout=5, what="the oldest to be closed")
        assert not any(_closed_by_server(client) for client in idle[2:])
    finally:
        for client in idle:
            client.close()
        server.stop()


def test_a_request_that_does_not_arrive_in_time_is_closed() -> None:
    """A client that sends part of a request and stops is closed at the request timeout."""
    health = Health(stall_seconds=50, alive_seconds=110)
    server = EndpointServer(
        "127.0.0.1", 0, PublisherMetrics(health).registry, health, request_timeout=0.5
    )
    server.start()
    try:
        with socket.create_connection(server.address, timeout=5) as slow:
            slow.sendall(b"GET /healthz HTTP/1.0\r\n")
            started = time.monotonic()
            wait_until(lambda: _closed_by_server(slow), timeout=5, what="the slow client closed")
            assert time.monotonic() - started >= 0.4
    finally:
        server.stop()


def test_an_oversized_request_is_closed_unanswered(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """Headers beyond MAX_REQUEST_BYTES are not read on: the connection is closed."""
    _, _, _, server = served
    with socket.create_connection(server.address, timeout=5) as client:
        client.sendall(b"GET /healthz HTTP/1.0\r\nX-Padding: " + b"a" * MAX_REQUEST_BYTES)
        client.settimeout(5)
        assert client.recv(1024) == b""


def test_other_methods_are_501_in_plain_text_that_does_not_echo_the_request(
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """Only GET and HEAD are served; the error is a short text without the client's input,
    in its body and in its status line (the default reason would quote the method)."""
    _, _, _, server = served
    for method in (b"POST", b"FOO<b>"):
        with socket.create_connection(server.address, timeout=5) as client:
            client.sendall(method + b" /healthz\x1b[2J HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
            response = client.makefile("rb").read()
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 501 Not Implemented\r\n"), head
        assert method not in head
        assert b"Content-Type: text/plain; charset=utf-8" in head
        assert body == b"501 Server does not support this operation\n"


def test_scrapes_held_by_a_silent_database_never_hold_a_probe() -> None:
    """The status read of /metrics hangs (a database that does not answer): more scrapes
    than workers come in, and /healthz and /readyz still answer at once."""
    health = Health(stall_seconds=50, alive_seconds=110)
    metrics = PublisherMetrics(health)
    released = threading.Event()
    reads: list[None] = []

    def hanging_read() -> list[Any]:
        reads.append(None)
        released.wait(30)
        return []

    metrics.watch_status(hanging_read)
    server = EndpointServer("127.0.0.1", 0, metrics.registry, health)
    server.start()
    host, port = server.address
    base = f"http://{host}:{port}"
    scrapes = [threading.Thread(target=_get, args=(base + "/metrics",)) for _ in range(8)]
    try:
        for scrape in scrapes:
            scrape.start()
        wait_until(lambda: reads, timeout=5, what="the first status read")
        for path in ("/healthz", "/readyz"):
            started = time.monotonic()
            status, _, _ = _get(base + path)
            assert status in (200, 503)
            assert time.monotonic() - started < 1.0, path
    finally:
        released.set()
        for scrape in scrapes:
            scrape.join(timeout=10)
        server.stop()
    assert len(reads) == 1  # the scrapes that came during the read did not read again


def test_a_scrape_during_a_read_is_answered_from_the_last_one() -> None:
    """Once a read has been made, a scrape that comes while the next one runs does not wait
    for it: it gets the last answer."""
    lines: list[Any] = [object()]
    read_started, release = threading.Event(), threading.Event()
    calls: list[None] = []

    def read() -> list[Any]:
        calls.append(None)
        if len(calls) > 1:
            read_started.set()
            release.wait(10)
        return lines

    now = [0.0]
    collector = StatusCollector(read, cache_seconds=5, clock=lambda: now[0])
    assert collector.rows() == lines
    now[0] += 6
    slow = threading.Thread(target=collector.rows)
    slow.start()
    try:
        assert read_started.wait(5)
        started = time.monotonic()
        assert collector.rows() == lines
        assert time.monotonic() - started < 0.5
    finally:
        release.set()
        slow.join(5)


@pytest.mark.parametrize("separator", [b"\x1c", b"\x1d", b"\x1e", b"\x1f", b"\x85", b"\xa0"])
def test_a_scrape_whose_request_line_splits_oddly_is_never_served_on_the_probe_thread(
    separator: bytes,
) -> None:
    """The handler splits the request line on \\x1c-\\x1f, \\x85 and \\xa0 too (str.split of
    latin-1): such a request for /metrics is a scrape, answered by a worker, and a slow
    status read under it holds no probe."""
    health = Health(stall_seconds=50, alive_seconds=110)
    metrics = PublisherMetrics(health)
    released = threading.Event()
    readers: list[str] = []

    def slow_read() -> list[Any]:
        readers.append(threading.current_thread().name)
        released.wait(10)
        return []

    metrics.watch_status(slow_read)
    server = EndpointServer("127.0.0.1", 0, metrics.registry, health)
    server.start()
    host, port = server.address
    answers: list[bytes] = []

    def scrape() -> None:
        with socket.create_connection(server.address, timeout=15) as client:
            client.sendall(b"GET" + separator + b"/metrics HTTP/1.0\r\n\r\n")
            answers.append(client.makefile("rb").read())

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        wait_until(lambda: readers, timeout=5, what="the status read")
        started = time.monotonic()
        assert _get(f"http://{host}:{port}/healthz")[0] == 200
        assert time.monotonic() - started < 1.0
    finally:
        released.set()
        scraper.join(timeout=15)
        server.stop()
    assert readers[0].startswith("outbox-http-worker-")
    assert answers[0].startswith(b"HTTP/1.0 200 ")
    assert b"outbox_database_up 1.0" in answers[0]


def test_the_probe_thread_never_scrapes_even_if_a_scrape_were_taken_for_a_probe(
    monkeypatch: pytest.MonkeyPatch,
    served: tuple[str, Health, PublisherMetrics, EndpointServer],
) -> None:
    """The accepting thread's handler has no registry: a request for /metrics that reached
    it (here every request is taken for a probe) is answered 503, and nothing is read."""
    base, _, metrics, _ = served
    reads: list[None] = []

    def read() -> list[Any]:
        reads.append(None)
        return []

    metrics.watch_status(read)
    monkeypatch.setattr("publisher.endpoints._is_probe", lambda request: True)
    status, content_type, _ = _get(base + "/metrics")
    assert (status, content_type) == (503, "text/plain; charset=utf-8")
    assert reads == []
    assert _get(base + "/healthz")[0] == 200
