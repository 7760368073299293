"""The real ``outbox-publisher`` serving /metrics, /healthz and /readyz, and its config file.

Each publisher listens on a free loopback port. The metrics are read back
with prometheus_client's own parser and compared with the database.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

import outbox
from tests.support import (
    count_by_state,
    fetch_rows,
    make_uncertain,
    small_topic,
    start_publisher,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.acceptance

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _free_port() -> int:
    """A loopback port nothing listens on (the kernel's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    """Status and body of a GET; ``(0, reason)`` while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, ConnectionError) as error:
        return 0, str(error)


def _scrape(base: str) -> Samples:
    status, body = _get(base + "/metrics")
    assert status == 200, body
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _ready_body(base: str) -> str | None:
    status, body = _get(base + "/readyz")
    return body if status == 200 else None


def _sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@contextmanager
def _running(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """Stop the publisher with SIGTERM at the end; it must exit 0."""
    try:
        yield process
    finally:
        stderr = stop_process(process, signal.SIGTERM, timeout=60)
        assert process.returncode == 0, stderr


def test_metrics_match_the_database_and_count_what_the_publisher_did(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Delivered, quarantined, uncertain and held messages: gauges, counters, histograms agree."""
    small = small_topic(kafka_bootstrap)
    with psycopg.connect(database_url) as conn:
        stays_uncertain = outbox.enqueue(conn, topic, b"unknown", key="u1")
    # Its producer could write for another hour: the reconciler must not decide it yet.
    make_uncertain(database_url, write_deadline_seconds=3_600)
    with psycopg.connect(database_url) as conn:
        reconciled = outbox.enqueue(conn, topic, b"absent", key="u2")
    # Due at once and not in Kafka: reconciled to pending, then delivered.
    make_uncertain(database_url, write_deadline_seconds=0)
    with psycopg.connect(database_url) as conn:
        fine = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(5)]
        )
        too_large = outbox.enqueue(conn, small, b"x" * 5_000, key="big")

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = start_publisher(
        database_url,
        kafka_bootstrap,
        "--http-host", "127.0.0.1",
        "--http-port", str(port),
        "--poll-interval", "0.2",
        "--reconcile-interval", "0.2",
        # The absent record is proof at once (no follower lags on one broker).
        "--absence-grace", "0",
    )  # fmt: skip
    with _running(process):
        wait_until(
            lambda: (
                count_by_state(database_url) == {"delivered": 6, "quarantined": 1, "uncertain": 1}
            ),
            timeout=60,
            what="deliveries, the quarantine and the reconciliation",
        )
        # Enqueued behind the quarantined message of its key: held, pending.
        with psycopg.connect(database_url) as conn:
            held = outbox.enqueue(conn, small, b"behind the big one", key="big")
        assert fetch_rows(
            database_url, "SELECT held_by, waiting FROM outbox.held_keys WHERE waiting > 0"
        ) == [(too_large, 1)]

        body = wait_until(lambda: _ready_body(base), timeout=30, what="/readyz to answer 200")
        assert body is not None
        assert json.loads(body)["ok"] is True
        assert _get(base + "/healthz")[0] == 200
        assert _get(base + "/nothing-here")[0] == 404

        in_database = {
            (t, s): n
            for t, s, n in fetch_rows(
                database_url,
                "SELECT topic, state, count(*) FROM outbox.messages "
                "WHERE state <> 'delivered' GROUP BY topic, state",
            )
        }
        assert in_database == {
            (topic, "uncertain"): 1,
            (small, "quarantined"): 1,
            (small, "pending"): 1,
        }

        def gauges_match() -> Samples | None:
            # The state counts are cached a few seconds: wait for a scrape after the enqueue.
            samples = _scrape(base)
            exported = {
                (dict(labels)["topic"], dict(labels)["state"]): value
                for (name, labels), value in samples.items()
                if name == "outbox_messages" and value
            }
            return samples if exported == in_database else None

        samples = wait_until(gauges_match, timeout=30, what="state gauges equal to the database")
        assert samples is not None

    assert _sample(samples, "outbox_database_up") == 1
    assert _sample(samples, "outbox_ready") == 1
    assert _sample(samples, "outbox_kafka_up") == 1
    assert _sample(samples, "outbox_messages", topic=small, state="in_flight") == 0
    assert _sample(samples, "outbox_messages", topic=small, state="delivered") is None
    oldest = _sample(samples, "outbox_oldest_pending_age_seconds", topic=small)
    assert oldest is not None
    assert oldest > 0
    assert _sample(samples, "outbox_oldest_pending_age_seconds", topic=topic) == 0

    assert _sample(samples, "outbox_deliveries_total", topic=topic) == 6
    assert _sample(samples, "outbox_failures_total", topic=small, **{"class": "non_retriable"}) == 1
    assert _sample(samples, "outbox_uncertain_resolved_total", to_state="pending") == 1
    assert _sample(samples, "outbox_uncertain_resolved_total", to_state="delivered") == 0
    # Six acknowledgements, each at most a minute after its commit.
    assert _sample(samples, "outbox_commit_to_ack_seconds_count") == 6
    assert _sample(samples, "outbox_commit_to_ack_seconds_bucket", le="60.0") == 6
    batches = _sample(samples, "outbox_batch_duration_seconds_count")
    assert batches is not None
    assert batches >= 1
    assert _sample(samples, "outbox_batches_total") == batches
    assert _sample(samples, "outbox_lease_losses_total", when="at_settle") == 0

    states = dict(fetch_rows(database_url, "SELECT id, state FROM outbox.messages"))
    assert states[stays_uncertain] == "uncertain"
    assert states[reconciled] == "delivered"
    assert all(states[i] == "delivered" for i in fine)
    assert (states[too_large], states[held]) == ("quarantined", "pending")


def test_readyz_is_503_naming_kafka_when_the_broker_does_not_answer(
    database_url: str,
) -> None:
    """Pointed at a port where no broker listens: alive, registered, database fine, not ready,
    and /readyz says kafka_unavailable without the address."""
    dead = f"127.0.0.1:{_free_port()}"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = start_publisher(
        database_url,
        dead,
        "--http-host", "127.0.0.1",
        "--http-port", str(port),
        "--reconcile-interval", "1",  # its passes are postponed while Kafka is away
    )  # fmt: skip
    with _running(process):

        def kafka_failed() -> dict[str, object] | None:
            status, body = _get(base + "/readyz")
            if status != 503:
                return None
            answer: dict[str, object] = json.loads(body)
            checks = answer["checks"]
            assert isinstance(checks, dict)
            return answer if checks["kafka"] == "kafka_unavailable" else None

        answer = wait_until(kafka_failed, timeout=60, what="/readyz to report Kafka failing")
        assert answer is not None
        assert answer["ok"] is False
        assert answer["failing"] == ["kafka"]
        # Only the code: not the address the publisher could not reach, nor what it was told.
        assert dead.split(":")[1] not in json.dumps(answer)
        assert _get(base + "/healthz")[0] == 200
        samples = _scrape(base)
        assert _sample(samples, "outbox_kafka_up") == 0
        assert _sample(samples, "outbox_ready") == 0
        assert _sample(samples, "outbox_database_up") == 1


def test_a_config_file_is_honoured(database_url: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    """Settings from --config take effect: the HTTP address and JSON logs from the file."""
    port = _free_port()
    path = tmp_path / "publisher.toml"
    path.write_text(
        f'http_host = "127.0.0.1"\nhttp_port = {port}\nlog_format = "json"\npoll_interval = 0.2\n'
    )
    # Empty: unset, so that the file's port counts (start_publisher turns HTTP off).
    process = start_publisher(
        database_url, kafka_bootstrap, "--config", str(path), env={"OUTBOX_HTTP_PORT": ""}
    )
    try:
        wait_until(
            lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200,
            timeout=30,
            what="/healthz on the port from the file",
        )
    finally:
        stderr = stop_process(process, signal.SIGTERM, timeout=60)
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert any(f"http://127.0.0.1:{port}" in line["message"] for line in lines)
    assert all(
        {"time", "level", "logger", "message", "publisher_id"} <= set(line) for line in lines
    )
    assert any("poll 0.2s" in line["message"] for line in lines)


def test_a_bad_config_file_exits_2_naming_each_bad_key(tmp_path: Path) -> None:
    """An unknown key and a value of the wrong type are refused before connecting anywhere."""
    path = tmp_path / "publisher.toml"
    path.write_text('batch_sise = 10\nlease_seconds = "long"\n')
    process = start_publisher("postgresql://127.0.0.1:1/none", "127.0.0.1:1", "--config", str(path))
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2, stderr
    assert stderr.splitlines() == [
        "outbox-publisher: invalid publisher configuration:",
        f"  config file {path}: unknown key 'batch_sise' (did you mean 'batch_size'?)",
        f'  config file {path}: lease_seconds = "long" is a string, expected a number',
    ]


def test_an_http_port_in_use_stops_the_start_with_exit_1(
    database_url: str, kafka_bootstrap: str
) -> None:
    """A publisher that cannot listen where it was told says so and exits 1, sending nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = start_publisher(
            database_url, kafka_bootstrap, "--http-host", "127.0.0.1", "--http-port", str(port)
        )
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert f"cannot serve metrics and health on 127.0.0.1:{port}" in stderr
    assert fetch_rows(database_url, "SELECT count(*) FROM outbox.publishers") == [(0,)]
