"""Fencing a producer session by its transactional.id, before its batch is decided.

In transactional delivery a batch is sent under the transactional.id of its
producer session. Before the reconciler reads the log to decide one of the
batch's messages, it takes that id over: ``init_transactions`` on a producer
of its own with the same transactional.id makes the coordinator bump the
epoch, abort the session's open transaction (or complete a commit already
under way), and refuse every later write or commit of the old session. Then
the log's committed records are the whole truth: a record found is
delivered, a record absent was never committed.
"""

from __future__ import annotations

from typing import Protocol

from kafka import KafkaProducer

from publisher.kafka_security import PLAINTEXT, KafkaSecurity


class Fencer(Protocol):
    """Takes a transactional.id over, so that its earlier sessions can write nothing more."""

    def fence(self, transactional_id: str) -> None:
        """Return once the id's earlier sessions are fenced; raise if that cannot be done now."""
        ...


class KafkaFencer:
    """Fences with a short-lived kafka-python producer per transactional.id."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        timeout_ms: int = 10_000,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        self._bootstrap_servers = bootstrap_servers
        self._timeout_ms = timeout_ms
        self._security = security

    def fence(self, transactional_id: str) -> None:
        """``init_transactions`` under ``transactional_id``, within the timeout, then close."""
        producer = KafkaProducer(
            bootstrap_servers=self._bootstrap_servers,
            client_id="outbox-fencer",
            transactional_id=transactional_id,
            max_block_ms=self._timeout_ms,
            request_timeout_ms=self._timeout_ms,
            # Else a broker that cannot be reached holds the fence (and the
            # loop that tries it) for kafka-python's default, 30 s.
            bootstrap_timeout_ms=self._timeout_ms,
            **self._security.kafka_python(),
        )
        try:
            producer.init_transactions()
        finally:
            producer.close(timeout=self._timeout_ms / 1000)
