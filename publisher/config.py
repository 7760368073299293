"""Publisher settings: defaults, environment variables, flags, and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from outbox.errors import OutboxError


class ConfigError(OutboxError):
    """A setting is missing, malformed, or contradicts another."""


@dataclass(frozen=True)
class PublisherConfig:
    """Everything a publisher needs to run; ``validate()`` names every problem."""

    database_url: str
    kafka_bootstrap: str
    #: Messages claimed, sent and confirmed together.
    batch_size: int = 500
    #: How long a claim is owned before another publisher may recover it.
    lease_seconds: float = 60.0
    #: Longest sleep between two claims when no notification arrives.
    poll_interval: float = 1.0
    #: Seconds between two heartbeats (and lease renewals) in ``outbox.publishers``.
    heartbeat_interval: float = 5.0
    #: Seconds between two passes of lease recovery (also run at start).
    recovery_interval: float = 5.0
    #: Seconds between two reconciliation passes over uncertain messages;
    #: 0 turns automatic reconciliation off (``outbox reconcile`` still works).
    reconcile_interval: float = 10.0
    #: Exit once nothing is left to deliver (for scripts and tests).
    exit_when_idle: bool = False
    #: First retry delay of a message Kafka did not take, doubled at each attempt.
    retry_base_seconds: float = 0.5
    retry_cap_seconds: float = 60.0
    #: A message Kafka did not take this many times is quarantined instead of
    #: retried again (at the 60 s cap, 50 attempts span about three quarters
    #: of an hour, enough to ride out a broker restart).
    max_attempts: int = 50
    linger_ms: int = 5
    #: How long a send or a topic lookup may block (kafka-python's max_block_ms).
    max_block_ms: int = 10_000
    #: Whether the publisher may create a missing topic (if the broker allows it).
    auto_create_topics: bool = True
    delivery_timeout_ms: int = 30_000
    request_timeout_ms: int = 10_000

    @property
    def longest_send_seconds(self) -> float:
        """The longest a batch may wait for the broker before it is given up."""
        return (self.delivery_timeout_ms + self.request_timeout_ms) / 1000

    def validate(self) -> None:  # noqa: PLR0912 - one flat check per setting reads best
        """Raise ``ConfigError`` listing every problem, one per line."""
        problems = []
        if not self.database_url:
            problems.append("database URL is missing (--database-url or OUTBOX_DATABASE_URL)")
        elif not self.database_url.startswith(("postgresql://", "postgres://")):
            problems.append(f"database URL {self.database_url!r} must start with postgresql://")
        if not self.kafka_bootstrap:
            problems.append(
                "Kafka bootstrap servers are missing (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP)"
            )
        else:
            for server in self.kafka_bootstrap.split(","):
                host, _, port = server.strip().rpartition(":")
                if not host or not port.isdigit():
                    problems.append(f"Kafka bootstrap server {server!r} is not host:port")
        if self.batch_size < 1:
            problems.append(f"batch size must be at least 1, got {self.batch_size}")
        if self.poll_interval <= 0:
            problems.append(f"poll interval must be positive, got {self.poll_interval}")
        if self.heartbeat_interval <= 0 or self.heartbeat_interval * 2 > self.lease_seconds:
            problems.append(
                f"heartbeat interval ({self.heartbeat_interval:g}s) must be positive and at most "
                f"half the lease ({self.lease_seconds:g}s), or leases lapse between renewals"
            )
        if self.recovery_interval <= 0:
            problems.append(f"recovery interval must be positive, got {self.recovery_interval}")
        if self.reconcile_interval < 0:
            problems.append(
                f"reconcile interval must be 0 (off) or positive, got {self.reconcile_interval}"
            )
        if self.retry_base_seconds <= 0 or self.retry_cap_seconds < self.retry_base_seconds:
            problems.append("retry delays need 0 < base <= cap")
        if self.max_attempts < 1:
            problems.append(f"max attempts must be at least 1, got {self.max_attempts}")
        if self.delivery_timeout_ms < self.linger_ms + self.request_timeout_ms:
            problems.append(
                "delivery timeout must be at least linger + request timeout "
                f"({self.delivery_timeout_ms} < {self.linger_ms} + {self.request_timeout_ms} ms)"
            )
        if self.lease_seconds <= self.longest_send_seconds:
            problems.append(
                f"lease ({self.lease_seconds:g}s) must be longer than the longest a send can "
                f"take (delivery + request timeout = {self.longest_send_seconds:g}s), or a "
                "batch could still be in flight when its lease expires"
            )
        if problems:
            raise ConfigError("invalid publisher configuration:\n  " + "\n  ".join(problems))
