"""The composition root (publisher/app.py) wires what the config asks for; nothing is contacted."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from publisher.app import build_app, build_publisher, start_warnings
from publisher.config import PublisherConfig
from publisher.retention import RetentionRunner


def _config(**overrides: Any) -> PublisherConfig:
    return PublisherConfig("postgresql://localhost/outbox", "localhost:9092", **overrides)


def test_retention_and_reconciliation_are_wired_only_when_configured() -> None:
    """A purge window adds a retention runner; reconcile interval 0 leaves out the reconciler."""
    plain = build_publisher(_config())
    assert plain.retention is None
    assert plain.reconciler is not None
    purging = build_publisher(_config(purge_delivered_after="7d", reconcile_interval=0))
    assert isinstance(purging.retention, RetentionRunner)
    assert purging.reconciler is None


def test_http_port_0_builds_no_endpoints() -> None:
    """With --http-port 0 the app is the publisher alone."""
    app = build_app(_config(http_port=0))
    assert app.endpoints is None


def test_an_address_in_use_fails_the_build() -> None:
    """The endpoints bind --http-host:--http-port while the app is built: a taken port fails it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use"):
            build_app(_config(http_host="127.0.0.1", http_port=taken.getsockname()[1]))


def test_a_publisher_without_reconciliation_says_so_at_start() -> None:
    """--reconcile-interval 0 is valid (another publisher reconciles) but easy to set by
    mistake: the start says who decides uncertain messages then."""
    assert start_warnings(_config()) == []
    [idempotent] = start_warnings(_config(reconcile_interval=0))
    assert idempotent.startswith("reconciliation is off (--reconcile-interval 0)")
    assert "unfenced" not in idempotent
    [transactional] = start_warnings(_config(reconcile_interval=0, delivery="transactional"))
    assert transactional.endswith("stay unfenced")


def test_an_absence_grace_shorter_than_kafkas_defaults_hide_a_record_says_so_at_start() -> None:
    """A grace under 1.5 times Kafka's default replica.lag.time.max.ms can prove a written
    but not yet readable record absent: valid (brokers may be tuned), but said at start,
    where reconciliation is on and waits out the grace (idempotent delivery)."""
    [short] = start_warnings(_config(absence_grace=30))
    assert short.startswith("the absence grace (30s, --absence-grace) is shorter than ")
    assert "45s, 1.5 times replica.lag.time.max.ms" in short
    assert start_warnings(_config(absence_grace=45)) == []
    assert start_warnings(_config(absence_grace=0, delivery="transactional")) == []
    [off] = start_warnings(_config(absence_grace=0, reconcile_interval=0))
    assert off.startswith("reconciliation is off")


def test_a_grace_that_outlasts_the_overdue_time_says_so_at_start() -> None:
    """outbox.status calls an uncertain message overdue 5 minutes past its write deadline:
    a grace (and the pass after it) that long makes every absent record look stuck."""
    [late] = start_warnings(_config(absence_grace=290, reconcile_interval=10))
    assert "(290s and 10s) reach the 300s past its write deadline" in late
    assert start_warnings(_config(absence_grace=289, reconcile_interval=10)) == []
    # Transactional delivery waits for no grace.
    assert start_warnings(_config(absence_grace=600, delivery="transactional")) == []


def test_a_transaction_setting_under_idempotent_delivery_is_said_to_be_ignored() -> None:
    """--transaction-records set for a publisher that sends no transactions does nothing:
    said at start, rather than silently."""
    [ignored] = start_warnings(_config(transaction_records=500))
    assert ignored.startswith("--transaction-records (500) is ignored: it applies to ")
    assert start_warnings(_config(transaction_records=500, delivery="transactional")) == []
