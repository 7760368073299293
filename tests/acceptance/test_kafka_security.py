"""The publisher and ``outbox-publisher reconcile`` against Kafka's SASL_SSL listener.

Delivery with each sink and delivery mode, a reconciliation pass, the health
probe, and a wrong password, which must end each command at once with one
line that names the cause. No output may carry the password.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

import outbox
from publisher.faults import CRASH_EXIT_CODE
from publisher.health import KafkaClusterCheck
from publisher.kafka_security import KafkaSecurity
from tests.secure_kafka import SecureKafka
from tests.support import (
    LONG_ABSENCE_GRACE,
    SINKS,
    assert_each_read_once,
    count_by_state,
    fast_publisher_flags,
    fault_env,
    fetch_rows,
    make_uncertain,
    read_topic,
    send_record,
    start_publisher,
)

pytestmark = pytest.mark.acceptance

#: A wrong password that no log line could contain by accident.
WRONG_PASSWORD = "wrong-" + uuid.uuid4().hex


def _enqueue(database_url: str, topic: str, count: int) -> list[uuid.UUID]:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue_many(
            conn, [outbox.Message(topic, {"n": i}, key=f"k{i % 3}") for i in range(count)]
        )


def _reconcile(
    database_url: str, env: dict[str, str], *flags: str
) -> subprocess.CompletedProcess[str]:
    """``outbox-publisher reconcile`` as a process, with ``env`` added to this one's."""
    return subprocess.run(
        [sys.executable, "-m", "publisher", "reconcile", "--database-url", database_url, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )


def _assert_no_secret(secure_kafka: SecureKafka, *outputs: str) -> None:
    for output in outputs:
        assert secure_kafka.password not in output
        assert WRONG_PASSWORD not in output


@pytest.mark.parametrize("delivery", ["idempotent", "transactional"])
@pytest.mark.parametrize("sink", SINKS)
def test_publisher_delivers_over_sasl_ssl(
    database_url: str,
    kafka_bootstrap: str,
    *,
    topic: str,
    secure_kafka: SecureKafka,
    sink: str,
    delivery: str,
) -> None:
    """Over SASL_SSL (SCRAM, TLS checked against the test CA) every message is delivered once,
    and no log line (JSON, DEBUG) carries the password."""
    ids = _enqueue(database_url, topic, 30)
    # The password from its file with one sink, from the environment with the other.
    password = secure_kafka.password if sink == "confluent" else None
    process = start_publisher(
        database_url,
        secure_kafka.bootstrap,
        "--exit-when-idle",
        "--sink",
        sink,
        "--delivery",
        delivery,
        "--log-format",
        "json",
        "--log-level",
        "DEBUG",
        env=secure_kafka.publisher_env(password=password),
    )
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    assert count_by_state(database_url) == {"delivered": 30}
    records = read_topic(kafka_bootstrap, topic, committed=True)
    assert sorted(r.outbox_id for r in records) == sorted(ids)
    assert "SASL_SSL, SCRAM-SHA-512 as 'outbox'" in stderr
    _assert_no_secret(secure_kafka, stdout, stderr)


def test_reconcile_decides_over_sasl_ssl(
    database_url: str, kafka_bootstrap: str, topic: str, secure_kafka: SecureKafka
) -> None:
    """``outbox-publisher reconcile`` logs in over SASL_SSL and decides a found and an absent
    message."""
    found, absent = _enqueue(database_url, topic, 2)
    partitions = make_uncertain(database_url)
    offset = send_record(kafka_bootstrap, topic, partitions[found], found)

    result = _reconcile(database_url, secure_kafka.publisher_env(), "--absence-grace", "0")
    assert result.returncode == 0, result.stderr
    assert "reconciled: 1 delivered, 1 pending (proven absent), 0 escalated" in result.stdout
    rows = dict(fetch_rows(database_url, "SELECT id, state::text FROM outbox.messages"))
    assert rows == {found: "delivered", absent: "pending"}
    assert fetch_rows(
        database_url, "SELECT kafka_offset FROM outbox.messages WHERE id = %s", found
    ) == [(offset,)]
    _assert_no_secret(secure_kafka, result.stdout, result.stderr)


def test_health_check_answers_over_sasl_ssl(secure_kafka: SecureKafka) -> None:
    """The Kafka check behind /readyz logs in and passes; with a wrong password it fails."""
    check = KafkaClusterCheck(secure_kafka.bootstrap, security=secure_kafka.security())
    try:
        check()
    finally:
        check.close()
    wrong = KafkaClusterCheck(
        secure_kafka.bootstrap,
        timeout_ms=2_000,
        security=secure_kafka.security(password=WRONG_PASSWORD),
    )
    try:
        with pytest.raises(Exception) as failure:  # noqa: PT011 - kafka-python's own error
            wrong()
    finally:
        wrong.close()
    assert WRONG_PASSWORD not in str(failure.value)


def test_plaintext_client_cannot_use_the_sasl_ssl_listener(secure_kafka: SecureKafka) -> None:
    """Without TLS and SASL the listener gives nothing away (the check fails)."""
    check = KafkaClusterCheck(secure_kafka.bootstrap, timeout_ms=2_000, security=KafkaSecurity())
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - any failure: it must not pass
            check()
    finally:
        check.close()


@pytest.mark.parametrize("sink", SINKS)
def test_wrong_password_stops_the_publisher_at_once_with_one_line(
    database_url: str, topic: str, secure_kafka: SecureKafka, sink: str
) -> None:
    """A refused login ends the publisher within seconds, exit 1, one line naming the cause."""
    _enqueue(database_url, topic, 3)
    started = time.monotonic()
    process = start_publisher(
        database_url,
        secure_kafka.bootstrap,
        "--sink",
        sink,
        env=secure_kafka.publisher_env(password=WRONG_PASSWORD),
    )
    stdout, stderr = process.communicate(timeout=60)
    took = time.monotonic() - started
    assert process.returncode == 1, stderr
    assert took < 15, f"took {took:.1f}s"
    errors = [line for line in stderr.splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1, stderr
    assert "Kafka authentication failed (SASL_SSL, SCRAM-SHA-512 as 'outbox')" in errors[0]
    assert count_by_state(database_url) == {"pending": 3}
    _assert_no_secret(secure_kafka, stdout, stderr)


def test_wrong_password_json_log_has_one_error_and_no_secret(
    database_url: str, secure_kafka: SecureKafka
) -> None:
    """In JSON logs too: one error object, naming the cause, without the password."""
    process = start_publisher(
        database_url,
        secure_kafka.bootstrap,
        "--log-format",
        "json",
        env=secure_kafka.publisher_env(password=WRONG_PASSWORD),
    )
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.get("level") == "ERROR"]
    assert len(errors) == 1, stderr
    assert "authentication failed" in errors[0]["message"]
    _assert_no_secret(secure_kafka, stdout, stderr)


def test_wrong_password_stops_reconcile_at_once_with_one_line(
    database_url: str, topic: str, secure_kafka: SecureKafka
) -> None:
    """``outbox-publisher reconcile`` with a refused login: exit 2 within seconds, one stderr
    line naming the cause, nothing moved."""
    _enqueue(database_url, topic, 1)
    make_uncertain(database_url)
    started = time.monotonic()
    result = _reconcile(
        database_url, secure_kafka.publisher_env(password=WRONG_PASSWORD), "--absence-grace", "0"
    )
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert took < 15, f"took {took:.1f}s"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "outbox-publisher reconcile: Kafka authentication failed (SASL_SSL, SCRAM-SHA-512 as "
    )
    assert count_by_state(database_url) == {"uncertain": 1}
    _assert_no_secret(secure_kafka, result.stdout, result.stderr)


def test_a_crash_mid_transaction_is_recovered_over_sasl_ssl(
    database_url: str, kafka_bootstrap: str, topic: str, secure_kafka: SecureKafka
) -> None:
    """A transactional publisher dies with its batch acknowledged but not committed; a
    fresh one, over SASL_SSL too, recovers it: the fence (init_transactions under the dead
    session's transactional.id) and the read_committed scan log in like the producer, the
    batch is proven absent and sent again, and every message is read once."""
    ids = _enqueue(database_url, topic, 20)
    flags = (*fast_publisher_flags(10), "--delivery", "transactional")
    flags += ("--absence-grace", f"{LONG_ABSENCE_GRACE:g}")
    crashed = start_publisher(
        database_url,
        secure_kafka.bootstrap,
        *flags,
        env={**secure_kafka.publisher_env(), **fault_env(crash_at="after_ack:1")},
    )
    _, crash_stderr = crashed.communicate(timeout=120)
    assert crashed.returncode == CRASH_EXIT_CODE, crash_stderr[-3000:]

    finisher = start_publisher(
        database_url,
        secure_kafka.bootstrap,
        *flags,
        "--exit-when-idle",
        env=secure_kafka.publisher_env(),
    )
    stdout, stderr = finisher.communicate(timeout=180)
    assert finisher.returncode == 0, stderr[-3000:]
    assert count_by_state(database_url) == {"delivered": 20}
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=True)
    decided = dict(
        fetch_rows(database_url, "SELECT to_state, count(*) FROM outbox.decisions GROUP BY 1")
    )
    assert decided == {"pending": 10}  # the crashed batch: fenced, absent, sent again
    _assert_no_secret(secure_kafka, crash_stderr, stdout, stderr)


def _other_ca(directory: Path) -> str:
    """A CA of its own, which did not sign the broker's certificate."""
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(directory / "other.key"), "-out", str(directory / "other.crt"),
            "-days", "1", "-subj", "/CN=another CA",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return str(directory / "other.crt")


def test_a_ca_that_did_not_sign_the_brokers_certificate_stops_each_command_at_once(
    database_url: str, topic: str, secure_kafka: SecureKafka, tmp_path: Path
) -> None:
    """kafka-python would log the failed handshake and retry it as an outage for ever: the
    publisher (exit 1) and reconcile (exit 2) stop within seconds with one line naming it."""
    _enqueue(database_url, topic, 1)
    env = {**secure_kafka.publisher_env(), "OUTBOX_KAFKA_SSL_CAFILE": _other_ca(tmp_path)}
    started = time.monotonic()
    process = start_publisher(database_url, secure_kafka.bootstrap, env=env)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert time.monotonic() - started < 15
    errors = [line for line in stderr.splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1, stderr
    assert f"Kafka TLS handshake with {secure_kafka.bootstrap} failed: " in errors[0]
    assert "not signed by --kafka-ssl-cafile" in errors[0]
    result = _reconcile(database_url, env)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "Kafka TLS handshake with " in line
    assert count_by_state(database_url) == {"pending": 1}
    _assert_no_secret(secure_kafka, stdout, stderr, result.stderr)


def test_a_ca_file_that_holds_no_certificate_is_a_configuration_error(
    database_url: str, secure_kafka: SecureKafka, tmp_path: Path
) -> None:
    """Any readable file passed the start before, and every handshake then failed: it is
    refused at start, exit 2, naming the setting."""
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    env = {**secure_kafka.publisher_env(), "OUTBOX_KAFKA_SSL_CAFILE": str(not_pem)}
    process = start_publisher(database_url, secure_kafka.bootstrap, env=env)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert f"--kafka-ssl-cafile {not_pem}: no CA certificate could be loaded from it" in stderr
