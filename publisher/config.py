"""Publisher settings: one declaration each, read from flags, environment, a file, defaults.

Every setting is a field of ``PublisherConfig`` and one ``Setting`` in
``SETTINGS``; from that one declaration come its flag (``--batch-size``), its
environment variable (``OUTBOX_BATCH_SIZE``), its key in the TOML config file
(``batch_size``) and its help line. ``resolve`` merges the sources, a flag
over its environment variable over the file over the default, and refuses
the whole configuration with one line per problem, so an operator fixes
everything in one round instead of one error per start.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import math
import os
import ssl
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict

from outbox.errors import OutboxError
from outbox.redaction import driver_url_problem, libpq_choice_problem, parse_reason
from outbox.redaction import redact as redact  # noqa: PLC0414 - moved there; callers keep this name
from outbox.retention import MIN_DELIVERED_AGE, parse_duration
from outbox.states import ABSENCE_GRACE_SECONDS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
#: The producers a publisher can send with (``--sink``).
SINKS = ("kafka-python", "confluent")
#: (The confluent sink.) librdkafka looks for timed-out records in its queues at least once a
#: second, and on the first turn after a pause of a second or more (a frozen
#: process); a produce request built before that scan may still take a
#: record whose ``message.timeout.ms`` has passed.
_TIMEOUT_SCAN_MS = 1_000
#: How long librdkafka lets such a request (built from a timed-out record) wait to be sent.
_LATE_REQUEST_MS = 100
#: The longest after its ``message.timeout.ms`` that librdkafka may still
#: write a record: built into a request up to one scan late, that request
#: allowed 100 ms, and, waiting in the output queue behind the requests in
#: flight, timed out by the next scan of that queue, up to a second later.
WRITE_MARGIN_MS = 2 * _TIMEOUT_SCAN_MS + _LATE_REQUEST_MS

#: Seconds after an uncertain message's write deadline before its record's
#: absence from Kafka counts as proof (``--absence-grace``): see
#: ``outbox.states.ABSENCE_GRACE_SECONDS``, which operators' decisions wait too.
DEFAULT_ABSENCE_GRACE = ABSENCE_GRACE_SECONDS
#: How long a follower that stopped copying can keep a written record unreadable with
#: Kafka's default replica.lag.time.max.ms (30 s): 1.5 times it.
KAFKA_DEFAULT_HIDDEN_SECONDS = 45.0
#: The least time one open transaction holds a partition's read_committed reads
#: back before the uncertain messages it keeps undecided say so: longer than
#: Kafka lets a producer's transaction stay open by default (transaction.timeout.ms,
#: 60 s, then the broker's sweep for expired ones, every 10 s).
LEAST_HELD_BACK_NOTE_SECONDS = 75.0

#: The largest value a numeric setting takes: seconds (every float setting) up
#: to a year, counts and milliseconds up to Kafka's (and PostgreSQL's) int32.
_LARGEST: dict[type, int] = {float: 365 * 24 * 3600, int: 2**31 - 1}

#: How a publisher delivers (``--delivery``); see docs/guarantees.md.
DELIVERY_MODES = ("idempotent", "transactional")

#: How the publisher's Kafka clients talk to the brokers (``--kafka-security-protocol``).
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
#: The SASL mechanisms the settings can configure on both sinks (``--kafka-sasl-mechanism``).
#: OAUTHBEARER needs a token provider (kafka-python) or an OIDC setup
#: (librdkafka) that no plain setting describes; GSSAPI a Kerberos setup.
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class ConfigError(OutboxError):
    """A setting is missing, malformed, or contradicts another."""


#: The shortest hand-over window (see ``PublisherConfig.hand_over_seconds``).
MIN_HAND_OVER_SECONDS = 1.0


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
    #: 0 turns automatic reconciliation off (``outbox-publisher reconcile`` still works).
    reconcile_interval: float = 10.0
    #: Seconds after an uncertain message's write deadline before its record's
    #: absence from Kafka counts as proof (see ``DEFAULT_ABSENCE_GRACE``).
    absence_grace: float = DEFAULT_ABSENCE_GRACE
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
    #: The producer library: ``kafka-python``, or ``confluent`` (librdkafka,
    #: from the ``confluent`` extra).
    sink: str = "kafka-python"
    #: ``idempotent`` (the default, safe for every consumer), or
    #: ``transactional``: each batch in a Kafka transaction, fenced by Kafka,
    #: exactly once for read_committed consumers.
    delivery: str = "idempotent"
    #: Transactional delivery under backlog: while each batch came back full,
    #: the next claimed batch joins the open transaction, up to this many
    #: records (a commit costs a fixed time, so a transaction must carry
    #: enough). A batch that came back short ends the transaction.
    transaction_records: int = 2_000
    delivery_timeout_ms: int = 30_000
    request_timeout_ms: int = 10_000
    #: Address of the metrics and health endpoints: every interface by default, as the
    #: container image needs; on a shared host 127.0.0.1 (docs/security.md).
    http_host: str = "0.0.0.0"  # noqa: S104 - a sidecar is scraped from outside its container
    #: Port of the metrics and health endpoints; 0 serves none.
    http_port: int = 9187
    #: Retention: delete delivered messages older than this (``7d``; see
    #: ``outbox purge``); empty leaves them all in place.
    purge_delivered_after: str = ""
    #: Retention: delete the evidence of purged messages once it is this old; empty:
    #: 30 days, or ``purge_delivered_after`` when that is longer.
    purge_evidence_after: str = ""
    #: Seconds between two retention passes (when ``purge_delivered_after`` is set).
    purge_interval: float = 3600.0
    log_level: str = "INFO"
    #: ``text`` for people, ``json`` (one object per line) for log collectors.
    log_format: str = "text"
    # Kafka security, for every Kafka client the publisher opens (producer,
    # reconciler's consumer, fencer, admin clients, health probe); mapped to
    # each client library's settings in ``publisher.kafka_security``.
    #: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    kafka_security_protocol: str = "PLAINTEXT"
    #: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (with a SASL_* protocol).
    kafka_sasl_mechanism: str = ""
    kafka_sasl_username: str = ""
    #: From the environment or the config file only, never a flag (it would show in ``ps``).
    kafka_sasl_password: str = field(default="", repr=False)
    #: A file holding the SASL password (its first line); instead of ``kafka_sasl_password``.
    kafka_sasl_password_file: str = ""
    #: PEM file of the CAs that sign the brokers' certificates; empty: the system's CAs.
    kafka_ssl_cafile: str = ""
    #: Client certificate and key (PEM) for brokers that authenticate clients by TLS.
    kafka_ssl_certfile: str = ""
    kafka_ssl_keyfile: str = ""
    #: The client key's password: environment or config file only, like the SASL password.
    kafka_ssl_key_password: str = field(default="", repr=False)
    kafka_ssl_key_password_file: str = ""
    #: Whether the broker's certificate must name the host connected to.
    kafka_ssl_check_hostname: bool = True

    @property
    def longest_send_seconds(self) -> float:
        """The longest a batch may wait for the broker before it is given up."""
        return (self.delivery_timeout_ms + self.request_timeout_ms) / 1000

    @property
    def hand_over_seconds(self) -> float:
        """How long after a batch is marked as sending its records may be handed over.

        A record whose turn comes later is not sent with this batch (it goes
        back to pending, unsent): it waits for a claim of its own. At least a
        second, so that a very small ``max_block_ms`` still leaves time to
        mark the batch and hand its records over.
        """
        return max(self.max_block_ms / 1000, MIN_HAND_OVER_SECONDS)

    @property
    def write_deadline_seconds(self) -> float:
        """From marking a batch as sending to when its producer can no longer write any record.

        The last record is handed over within ``hand_over_seconds``; handing
        it over may block ``max_block_ms``; the producer then gives up on it
        within the delivery and request timeouts. Only after this deadline
        may the reconciler take a record's absence for proof.
        """
        return self.hand_over_seconds + self.max_block_ms / 1000 + self.longest_send_seconds

    @property
    def held_back_note_seconds(self) -> float:
        """How long one open transaction may hold a partition's reads back before the
        uncertain messages it keeps undecided say so: ``LEAST_HELD_BACK_NOTE_SECONDS``,
        or longer than this publisher's own transactions can last (its write deadline)."""
        return max(LEAST_HELD_BACK_NOTE_SECONDS, self.write_deadline_seconds + 15.0)

    @property
    def min_purge_delivered_seconds(self) -> float:
        """The shortest ``purge_delivered_after``: the write deadline plus the absence grace.

        Until then an uncertain message may still be reconciled, and the
        delivered messages after it of its key are its evidence that the key
        moved on. Never under the library's floor (``MIN_DELIVERED_AGE``).
        """
        return max(
            self.write_deadline_seconds + self.absence_grace, MIN_DELIVERED_AGE.total_seconds()
        )

    @property
    def stall_seconds(self) -> float:
        """How long the loop may go without a turn before it counts as stuck.

        A turn can legitimately take until the write deadline, and an idle
        loop turns at least every poll interval.
        """
        return max(3 * self.poll_interval, self.write_deadline_seconds + 10)

    def validate(self) -> None:
        """Raise ``ConfigError`` listing every problem, one per line."""
        problems = [p.text for p in self.problems()]
        if problems:
            raise ConfigError(_heading(problems))

    def problems(self) -> list[Problem]:  # noqa: PLR0912, PLR0915 - one flat check per setting reads best
        """Every problem of this config, each with the settings it concerns."""
        problems: list[Problem] = []

        def problem(names: str, text: str) -> None:
            problems.append(Problem(frozenset(names.split()), text))

        if not self.database_url:
            problem(
                "database_url", "database URL is missing (--database-url or OUTBOX_DATABASE_URL)"
            )
        else:
            url_problem = _database_url_problem(self.database_url)
            if url_problem:
                problem("database_url", url_problem)
        if not self.kafka_bootstrap:
            problem(
                "kafka_bootstrap",
                "Kafka bootstrap servers are missing (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP)",
            )
        else:
            for server in self.kafka_bootstrap.split(","):
                host, _, port = server.strip().rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    problem(
                        "kafka_bootstrap", f"Kafka bootstrap server {server!r} is not host:port"
                    )
        if self.batch_size < 1:
            problem("batch_size", f"batch size must be at least 1, got {self.batch_size}")
        if self.poll_interval <= 0:
            problem("poll_interval", f"poll interval must be positive, got {self.poll_interval}")
        if self.heartbeat_interval <= 0 or self.heartbeat_interval * 3 > self.lease_seconds:
            # A lease is renewed once less than half of it is left: at half, that
            # window is one heartbeat long, and a beat that comes late (the ticks
            # drift) or skips the batch (locked by its mark at that instant) lets
            # a healthy publisher's lease lapse. At a third, every window holds two.
            problem(
                "heartbeat_interval lease_seconds",
                f"heartbeat interval ({self.heartbeat_interval:g}s) must be positive and at most "
                f"a third of the lease ({self.lease_seconds:g}s), or leases lapse between "
                "renewals",
            )
        if self.recovery_interval <= 0:
            problem(
                "recovery_interval",
                f"recovery interval must be positive, got {self.recovery_interval}",
            )
        if self.reconcile_interval < 0:
            problem(
                "reconcile_interval",
                f"reconcile interval must be 0 (off) or positive, got {self.reconcile_interval}",
            )
        if self.absence_grace < 0:
            problem("absence_grace", f"absence grace must be 0 or more, got {self.absence_grace}")
        if self.retry_base_seconds <= 0 or self.retry_cap_seconds < self.retry_base_seconds:
            problem("retry_base_seconds retry_cap_seconds", "retry delays need 0 < base <= cap")
        if self.max_attempts < 1:
            problem("max_attempts", f"max attempts must be at least 1, got {self.max_attempts}")
        if self.delivery_timeout_ms < self.linger_ms + self.request_timeout_ms:
            problem(
                "delivery_timeout_ms linger_ms request_timeout_ms",
                "delivery timeout must be at least linger + request timeout "
                f"({self.delivery_timeout_ms} < {self.linger_ms} + {self.request_timeout_ms} ms)",
            )
        if self.lease_seconds <= self.longest_send_seconds:
            problem(
                "lease_seconds delivery_timeout_ms request_timeout_ms",
                f"lease ({self.lease_seconds:g}s) must be longer than the longest a send can "
                f"take (delivery + request timeout = {self.longest_send_seconds:g}s), or a "
                "batch could still be in flight when its lease expires",
            )
        windows = {}
        for name in ("purge_delivered_after", "purge_evidence_after"):
            text = getattr(self, name)
            if text:
                try:
                    windows[name] = parse_duration(text)
                except ValueError as exc:
                    problem(name, f"{name.replace('_', ' ')}: {exc}")
        delivered = windows.get("purge_delivered_after")
        if delivered is not None and delivered.total_seconds() < self.min_purge_delivered_seconds:
            problem(
                "purge_delivered_after",
                f"purge delivered after ({self.purge_delivered_after}) must be at least "
                f"{self.min_purge_delivered_seconds:g}s: the write deadline "
                f"({self.write_deadline_seconds:g}s) plus the absence grace "
                f"({self.absence_grace:g}s), and never under {MIN_DELIVERED_AGE.total_seconds():g}s"
                "; a delivered message must outlive the reconciliation of uncertain ones before it",
            )
        if len(windows) == 2 and windows["purge_evidence_after"] < windows["purge_delivered_after"]:
            problem(
                "purge_evidence_after purge_delivered_after",
                f"purge evidence after ({self.purge_evidence_after}) must be at least purge "
                f"delivered after ({self.purge_delivered_after}): evidence must not go before "
                "the messages it explains",
            )
        for name, least in (
            ("transaction_records", 1),
            ("linger_ms", 0),
            ("max_block_ms", 1),
            ("request_timeout_ms", 1),
            ("delivery_timeout_ms", 1),
        ):
            if getattr(self, name) < least:
                problem(
                    name,
                    f"{name.replace('_', ' ')} must be at least {least}, got {getattr(self, name)}",
                )
        if self.sink not in SINKS:
            problem("sink", f"sink {self.sink!r} is not one of {', '.join(SINKS)}")
        elif self.sink == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
            problem(
                "sink",
                "sink 'confluent' needs the confluent-kafka package: "
                "pip install 'pg-kafka-outbox[confluent]'",
            )
        if (
            self.sink == "confluent"
            and self.delivery_timeout_ms + self.request_timeout_ms <= WRITE_MARGIN_MS
        ):
            problem(
                "delivery_timeout_ms request_timeout_ms",
                f"with the confluent sink, the delivery timeout ({self.delivery_timeout_ms} ms) "
                f"and the request timeout ({self.request_timeout_ms} ms) must add up to more "
                f"than {WRITE_MARGIN_MS} ms: librdkafka may write a record up to "
                f"{WRITE_MARGIN_MS} ms after its message.timeout.ms, and must have given it "
                "up before the batch's write deadline",
            )
        if self.delivery not in DELIVERY_MODES:
            problem(
                "delivery",
                f"delivery {self.delivery!r} is not one of {', '.join(DELIVERY_MODES)}",
            )
        if self.purge_interval <= 0:
            problem("purge_interval", f"purge interval must be positive, got {self.purge_interval}")
        if not 0 <= self.http_port <= 65535:
            problem("http_port", f"HTTP port must be 0 (off) or 1-65535, got {self.http_port}")
        elif self.http_port and not self.http_host.strip():
            problem("http_host", "HTTP host is empty (use 0.0.0.0 for every interface)")
        if self.log_level not in LOG_LEVELS:
            problem(
                "log_level",
                f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}",
            )
        if self.log_format not in LOG_FORMATS:
            problem(
                "log_format",
                f"log format {self.log_format!r} is not one of {', '.join(LOG_FORMATS)}",
            )
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            most = _LARGEST.get(setting.kind) if setting.name != "http_port" else None
            if most is not None and value > most:
                # Past what the clocks, PostgreSQL's columns or Kafka's int32
                # fields can hold: refused here, not at the first claim.
                unit, shown = (
                    (" seconds", f"{value:g}") if setting.kind is float else ("", f"{value:,}")
                )
                problem(
                    setting.name,
                    f"{setting.name.replace('_', ' ')} must be at most {most:,}{unit}, got {shown}",
                )
        problems += kafka_security_problems(self)
        return problems


def kafka_security_problems(config: PublisherConfig) -> list[Problem]:  # noqa: PLR0912 - one flat check per setting reads best
    """What is wrong with the Kafka security settings of ``config`` (secrets never shown).

    Files named by the settings must be readable now: a typo in a path is
    found at start rather than at the first TLS handshake.
    """
    problems: list[Problem] = []

    def problem(names: str, text: str) -> None:
        problems.append(Problem(frozenset(names.split()), text))

    protocol = config.kafka_security_protocol
    sasl = protocol in ("SASL_PLAINTEXT", "SASL_SSL")
    tls = protocol in ("SSL", "SASL_SSL")
    if protocol not in SECURITY_PROTOCOLS:
        problem(
            "kafka_security_protocol",
            f"Kafka security protocol {protocol!r} is not one of {', '.join(SECURITY_PROTOCOLS)}",
        )
        return problems
    mechanism = config.kafka_sasl_mechanism
    if sasl:
        if not mechanism:
            problem(
                "kafka_sasl_mechanism",
                f"Kafka security protocol {protocol} needs a SASL mechanism "
                f"(--kafka-sasl-mechanism: {', '.join(SASL_MECHANISMS)})",
            )
        elif mechanism not in SASL_MECHANISMS:
            problem(
                "kafka_sasl_mechanism",
                f"Kafka SASL mechanism {mechanism!r} is not one of {', '.join(SASL_MECHANISMS)} "
                "(see docs/publisher.md, Kafka security)",
            )
        if not config.kafka_sasl_username:
            problem(
                "kafka_sasl_username",
                f"Kafka security protocol {protocol} needs a SASL username "
                "(--kafka-sasl-username or OUTBOX_KAFKA_SASL_USERNAME)",
            )
        if config.kafka_sasl_password and config.kafka_sasl_password_file:
            problem(
                "kafka_sasl_password kafka_sasl_password_file",
                "Kafka SASL password: set OUTBOX_KAFKA_SASL_PASSWORD or "
                "--kafka-sasl-password-file, not both",
            )
        elif not config.kafka_sasl_password and not config.kafka_sasl_password_file:
            problem(
                "kafka_sasl_password kafka_sasl_password_file",
                f"Kafka security protocol {protocol} needs a SASL password "
                "(OUTBOX_KAFKA_SASL_PASSWORD, or --kafka-sasl-password-file FILE)",
            )
    else:
        given = [
            s.named
            for s in SETTINGS
            if s.name.startswith("kafka_sasl_") and getattr(config, s.name)
        ]
        if given:
            problem(
                "kafka_security_protocol",
                f"Kafka SASL settings ({', '.join(given)}) are set, but the security protocol is "
                f"{protocol}: use SASL_SSL (or SASL_PLAINTEXT), or leave them out",
            )
    if not tls:
        given = [
            s.named
            for s in SETTINGS
            if s.name.startswith("kafka_ssl_") and getattr(config, s.name) != s.default
        ]
        if given:
            problem(
                "kafka_security_protocol",
                f"Kafka TLS settings ({', '.join(given)}) are set, but the security protocol is "
                f"{protocol}: use SSL or SASL_SSL, or leave them out",
            )
    if bool(config.kafka_ssl_certfile) != bool(config.kafka_ssl_keyfile):
        problem(
            "kafka_ssl_certfile kafka_ssl_keyfile",
            "Kafka TLS client certificate and key go together: set both "
            "--kafka-ssl-certfile and --kafka-ssl-keyfile, or neither",
        )
    if config.kafka_ssl_key_password and config.kafka_ssl_key_password_file:
        problem(
            "kafka_ssl_key_password kafka_ssl_key_password_file",
            "Kafka TLS key password: set OUTBOX_KAFKA_SSL_KEY_PASSWORD or "
            "--kafka-ssl-key-password-file, not both",
        )
    elif (
        tls
        and (config.kafka_ssl_key_password or config.kafka_ssl_key_password_file)
        and not config.kafka_ssl_keyfile
    ):
        problem(
            "kafka_ssl_key_password kafka_ssl_key_password_file",
            "a Kafka TLS key password is set, but no key (--kafka-ssl-keyfile) to open with it",
        )
    for name in (
        "kafka_sasl_password_file",
        "kafka_ssl_cafile",
        "kafka_ssl_certfile",
        "kafka_ssl_keyfile",
        "kafka_ssl_key_password_file",
    ):
        path = getattr(config, name)
        if path and (trouble := _unreadable(path)):
            flag = f"--{name.replace('_', '-')}"
            if name.endswith("password_file"):
                # A password typed here by mistake would be shown: name the setting only.
                problem(
                    name,
                    f"{flag}: the file {trouble} (its path is not shown: it may be a "
                    "password given in the wrong place)",
                )
            else:
                problem(name, f"{flag} {path}: {trouble}")
    for name in ("kafka_sasl_password_file", "kafka_ssl_key_password_file"):
        path = getattr(config, name)
        if path and not _unreadable(path) and (trouble := _secret_file_problem(path)):
            problem(name, f"--{name.replace('_', '-')} {path}: {trouble}")
    if tls and not problems and (trouble := _tls_files_problem(config)):
        # The files are there: they must load too, said with every other problem.
        problem("kafka_ssl_cafile kafka_ssl_certfile kafka_ssl_keyfile", trouble)
    return problems


def secret_of(value: str, path: str) -> str:
    """A secret given as itself (``value``) or in a file (``path``, read now)."""
    return read_secret_file(path) if path else value


def _tls_files_problem(config: PublisherConfig) -> str | None:
    """Why the TLS files of ``config`` (each readable) do not load, or ``None``."""
    try:
        tls_context(
            config.kafka_ssl_cafile,
            config.kafka_ssl_certfile,
            config.kafka_ssl_keyfile,
            secret_of(config.kafka_ssl_key_password, config.kafka_ssl_key_password_file),
            check_hostname=config.kafka_ssl_check_hostname,
        )
    except ConfigError as exc:
        return str(exc)
    return None


def tls_context(
    cafile: str, certfile: str, keyfile: str, key_password: str, *, check_hostname: bool
) -> ssl.SSLContext:
    """The TLS context of these settings, as kafka-python builds its own.

    Raises ``ConfigError`` naming the setting whose file cannot be used (a
    CA file with no PEM certificate, a key that does not match its
    certificate or its password): found at start, not as an outage.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = check_hostname
    try:
        if cafile:
            context.load_verify_locations(cafile=cafile)
        else:
            context.load_default_certs()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--kafka-ssl-cafile {cafile}: no CA certificate could be loaded "
            f"from it ({_ssl_reason(exc)}); it must hold PEM certificates"
        ) from None
    if certfile:
        # A password, never None: OpenSSL would ask for an encrypted key's on the terminal.
        password = key_password or (lambda: b"")
        try:
            context.load_cert_chain(certfile, keyfile or None, password)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"--kafka-ssl-certfile {certfile} and --kafka-ssl-keyfile "
                f"{keyfile}: the client certificate could not be loaded "
                f"({_ssl_reason(exc)}); check both files (PEM) and the key's password "
                "(an encrypted key needs OUTBOX_KAFKA_SSL_KEY_PASSWORD or "
                "--kafka-ssl-key-password-file)"
            ) from None
    return context


def _ssl_reason(exc: BaseException) -> str:
    """An ``ssl`` error's reason in a few words (``NO_CERTIFICATE_OR_CRL_FOUND``)."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    return getattr(exc, "strerror", None) or str(exc)


def _secret_file_problem(path: str) -> str | None:
    """Why the readable file ``path`` holds no secret ``read_secret_file`` can use, or None."""
    try:
        if read_secret_file(path):
            return None
    except UnicodeDecodeError:
        return "its first line is not UTF-8"
    if Path(path).stat().st_size == 0:
        return "the file is empty"
    return "its first line is empty (the secret is read from the first line)"


def _unreadable(path: str) -> str | None:
    """Why ``path`` cannot be read as a file, or ``None``."""
    try:
        with Path(path).open("rb"):
            return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"


def read_secret_file(path: str) -> str:
    """A secret kept in a file: its first line, without the line break (the rest is ignored)."""
    with Path(path).open(encoding="utf-8") as f:
        return f.readline().rstrip("\r\n")


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a configuration is refused, and the settings it concerns."""

    fields: frozenset[str]
    text: str


def _heading(problems: Collection[str]) -> str:
    return "invalid publisher configuration:\n  " + "\n  ".join(problems)


def _database_url_problem(url: str) -> str | None:
    shown = redact(url)
    if not url.startswith(("postgresql://", "postgres://")):
        return driver_url_problem(url) or f"database URL {shown!r} must start with postgresql://"
    try:
        parts = conninfo_to_dict(url)
    except ProgrammingError as exc:
        return f"database URL {shown!r} does not parse: {parse_reason(str(exc))}"
    ports = str(parts.get("port") or "5432").split(",")
    if not all(p.isdigit() and 0 < int(p) < 65536 for p in ports):
        return f"database URL {shown!r} has an invalid port {parts.get('port')!r}"
    choice = libpq_choice_problem(parts)
    return f"database URL {shown!r} {choice}" if choice else None


# --- the settings, declared once -------------------------------------------------

#: Headings of ``--help``, in order.
GROUPS = (
    "connections",
    "batches and leases",
    "recovery and reconciliation",
    "retries",
    "Kafka producer",
    "metrics and health over HTTP",
    "retention",
    "logs",
    "Kafka security",
)


@dataclass(frozen=True)
class Setting:
    """One setting: a ``PublisherConfig`` field, and from its name the flag, variable and key."""

    name: str
    kind: type
    help: str
    group: str
    #: A flag other than ``--name-with-dashes`` (``--no-auto-create-topics``).
    flag_name: str | None = None
    #: For a boolean, the value its flag sets (the flag takes no argument).
    flag_sets: bool | None = None
    #: Values shown in its error messages are redacted (they may hold a password).
    secret: bool = False
    #: Shown as the default in ``--help`` when the default is empty.
    unset: str = ""
    #: False for a secret: it comes from the environment, the config file or
    #: a file of its own, never from a flag (a flag's value shows in ``ps``).
    has_flag: bool = True
    metavar: str | None = None
    #: Normalises text values (``info`` -> ``INFO``).
    normalise: str = field(default="", repr=False)
    #: The word ``off`` (any case) unsets it, as its default is shown in ``--help``.
    off: bool = False

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable."""
        return "OUTBOX_" + self.name.upper()

    @property
    def named(self) -> str:
        """How an error names it: its flag, or for a secret (no flag) its variable."""
        return self.flag if self.has_flag else self.env

    @property
    def key(self) -> str:
        """The key in the config file."""
        return self.name

    @property
    def default(self) -> object:
        """The default value, from ``PublisherConfig``."""
        return _DEFAULTS[self.name]

    def add_flag(self, group: argparse._ArgumentGroup, *, show_default: bool = True) -> None:
        """Add this setting's flag to ``group`` (none for a secret). A flag not given
        leaves the setting to the environment, the config file and the default."""
        if not self.has_flag:
            return
        if self.flag_sets is not None:
            group.add_argument(
                self.flag,
                dest=self.name,
                action="store_const",
                const=self.flag_sets,
                default=argparse.SUPPRESS,
                help=f"{self.help} [{self.env}={str(self.flag_sets).lower()}]",
            )
            return
        default = self.default
        shown = (
            self.unset
            if default in (None, "")
            else f"{default:g}"
            if isinstance(default, float)
            else default
        )
        group.add_argument(
            self.flag,
            dest=self.name,
            metavar=self.metavar,
            default=argparse.SUPPRESS,
            help=f"{self.help}{f' (default {shown})' if show_default else ''} [{self.env}]",
        )


_DEFAULTS: dict[str, object] = {
    f.name: (None if f.default is MISSING else f.default) for f in fields(PublisherConfig)
}

SETTINGS: tuple[Setting, ...] = (
    Setting("database_url", str,
            "PostgreSQL URL, postgresql://user@host:port/dbname (the password best from "
            "PGPASSFILE or PGPASSWORD)",
            "connections", secret=True, unset="none", metavar="URL"),
    Setting("kafka_bootstrap", str, "Kafka bootstrap servers, host:port[,host:port...]",
            "connections", unset="none", metavar="SERVERS"),
    Setting("batch_size", int, "messages claimed, sent and confirmed together",
            "batches and leases", metavar="N"),
    Setting("lease_seconds", float, "how long a claim is owned; must exceed delivery + request "
            "timeout", "batches and leases", metavar="SECONDS"),
    Setting("poll_interval", float, "longest wait between claims when no NOTIFY arrives",
            "batches and leases", metavar="SECONDS"),
    Setting("heartbeat_interval", float, "seconds between heartbeats and lease renewals; at most "
            "a third of the lease", "batches and leases", metavar="SECONDS"),
    Setting("exit_when_idle", bool, "exit 0 once nothing is in flight, awaiting reconciliation "
            "or pending (except behind a message only an operator can move); for scripts and "
            "tests", "batches and leases", flag_sets=True),
    Setting("recovery_interval", float, "seconds between passes that recover expired leases "
            "(and hold or release the messages behind an uncertain or quarantined one)",
            "recovery and reconciliation", metavar="SECONDS"),
    Setting("reconcile_interval", float, "seconds between reconciliation passes over uncertain "
            "messages; 0 for none", "recovery and reconciliation", metavar="SECONDS"),
    Setting("absence_grace", float, "seconds after a write deadline before a record's absence "
            "from Kafka is proof; at least 1.5 times the brokers' replica.lag.time.max.ms",
            "recovery and reconciliation", metavar="SECONDS"),
    Setting("retry_base_seconds", float, "first retry delay of a message Kafka did not take; "
            "doubles per attempt", "retries", metavar="SECONDS"),
    Setting("retry_cap_seconds", float, "longest retry delay", "retries", metavar="SECONDS"),
    Setting("max_attempts", int, "failures after which a message Kafka keeps not taking "
            "(not written) is quarantined; a broker outage counts at most once", "retries",
            metavar="N"),
    Setting("delivery_timeout_ms", int, "producer delivery timeout", "Kafka producer",
            metavar="MS"),
    Setting("request_timeout_ms", int, "producer request timeout", "Kafka producer", metavar="MS"),
    Setting("linger_ms", int, "producer linger", "Kafka producer", metavar="MS"),
    Setting("max_block_ms", int, "longest a send or a topic lookup may block; also the "
            "batch's hand-over window", "Kafka producer", metavar="MS"),
    Setting("auto_create_topics", bool, "never create a missing topic: its messages are "
            "quarantined (TopicMissing)", "Kafka producer", flag_name="--no-auto-create-topics",
            flag_sets=False),
    Setting("sink", str, "producer library: kafka-python, or confluent (librdkafka; pip install "
            "'pg-kafka-outbox[confluent]')", "Kafka producer", normalise="lower", metavar="NAME"),
    Setting("delivery", str, "idempotent, or transactional: each batch in a Kafka transaction "
            "that Kafka fences, exactly once for read_committed consumers", "Kafka producer",
            normalise="lower", metavar="MODE"),
    Setting("transaction_records", int, "transactional delivery under backlog: full batches "
            "join one transaction up to this many records", "Kafka producer", metavar="N"),
    Setting("http_host", str, "address of /metrics, /healthz and /readyz (0.0.0.0: every "
            "interface, as a container needs; 127.0.0.1: this host only)", "metrics and health "
            "over HTTP", metavar="HOST"),
    Setting("http_port", int, "port of /metrics, /healthz and /readyz; 0 serves none",
            "metrics and health over HTTP", metavar="PORT"),
    Setting("purge_delivered_after", str, "delete delivered messages older than this (e.g. 7d; "
            "units s, m, h, d, w; at least the write deadline plus the absence grace, and 5m); "
            "unset keeps them", "retention", unset="off", metavar="AGE", off=True),
    Setting("purge_evidence_after", str, "delete the evidence of purged messages once it is "
            "this old (never while its message is kept; at least --purge-delivered-after)",
            "retention", unset="30d, or --purge-delivered-after if longer", metavar="AGE"),
    Setting("purge_interval", float, "seconds between retention passes", "retention",
            metavar="SECONDS"),
    Setting("log_level", str, "DEBUG, INFO, WARNING or ERROR", "logs", normalise="upper",
            metavar="LEVEL"),
    Setting("log_format", str, "text, or json for one JSON object per line", "logs",
            normalise="lower", metavar="FORMAT"),
    Setting("kafka_security_protocol", str, "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, for "
            "every Kafka client the publisher opens", "Kafka security", normalise="upper",
            metavar="PROTOCOL"),
    Setting("kafka_sasl_mechanism", str, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
            "Kafka security", normalise="upper", unset="none", metavar="MECHANISM"),
    Setting("kafka_sasl_username", str, "SASL username", "Kafka security", unset="none",
            metavar="NAME"),
    Setting("kafka_sasl_password", str, "SASL password (no flag: it would show in ps)",
            "Kafka security", secret=True, unset="none", has_flag=False),
    Setting("kafka_sasl_password_file", str, "file whose first line is the SASL password "
            "(or set OUTBOX_KAFKA_SASL_PASSWORD)", "Kafka security", unset="none",
            metavar="FILE"),
    Setting("kafka_ssl_cafile", str, "PEM file of the CAs that sign the brokers' certificates",
            "Kafka security", unset="the system's CAs", metavar="FILE"),
    Setting("kafka_ssl_certfile", str, "client certificate (PEM), for brokers that "
            "authenticate clients by TLS", "Kafka security", unset="none", metavar="FILE"),
    Setting("kafka_ssl_keyfile", str, "the client certificate's private key (PEM)",
            "Kafka security", unset="none", metavar="FILE"),
    Setting("kafka_ssl_key_password", str, "password of that key (no flag: it would show in ps)",
            "Kafka security", secret=True, unset="none", has_flag=False),
    Setting("kafka_ssl_key_password_file", str, "file whose first line is the key's password "
            "(or set OUTBOX_KAFKA_SSL_KEY_PASSWORD)", "Kafka security", unset="none",
            metavar="FILE"),
    Setting("kafka_ssl_check_hostname", bool, "do not check that the broker's certificate names "
            "the host connected to (weakens TLS: anyone with a certificate from the CA can pose "
            "as the broker)", "Kafka security", flag_name="--no-kafka-ssl-check-hostname",
            flag_sets=False),
)  # fmt: skip

#: The environment variable naming the config file (its flag is ``--config``).
CONFIG_ENV = "OUTBOX_CONFIG"


def config_file_named(given: dict[str, object], environ: Mapping[str, str]) -> str | None:
    """The config file to read, taking ``config`` out of the parsed flags ``given``:
    ``--config``'s (given empty: none, whatever ``OUTBOX_CONFIG`` says), else the
    variable's, else none."""
    if "config" in given:
        return str(given.pop("config")) or None
    return environ.get(CONFIG_ENV) or None


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class _BadValue(Exception):
    """A value of the wrong type or form; the message says what was expected."""


def _from_text(setting: Setting, raw: str) -> object:
    """Convert a flag or environment value."""
    kind = setting.kind
    text = raw.strip()
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise _BadValue("expected true or false")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise _BadValue("expected an integer") from None
    if kind is float:
        try:
            number = float(text)
        except ValueError:
            raise _BadValue("expected a number") from None
        if not math.isfinite(number):
            raise _BadValue("expected a finite number")
        return number
    return _normalised(setting, raw)


def _from_file(setting: Setting, value: object) -> object:
    """Check a value read from TOML, which is already typed."""
    kind = setting.kind
    # bool is an int in Python, but `batch_size = true` is a mistake.
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _BadValue("expected a finite number")
        return float(value)
    if kind is str and isinstance(value, str):
        return _normalised(setting, value)
    raise _BadValue(f"is {_toml_kind(value)}, expected {_KIND_NAMES[kind]}")


def _normalised(setting: Setting, value: str) -> str:
    if setting.off and value.strip().lower() == "off":
        return ""
    if setting.normalise == "upper":
        return value.strip().upper()
    if setting.normalise == "lower":
        return value.strip().lower()
    return value.strip()


#: What a TOML value is, in words; bool first, since a TOML boolean is a Python int too.
_TOML_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "an array"),
    (dict, "a table"),
)


def _toml_kind(value: object) -> str:
    default = f"a {type(value).__name__}"  # given from Python (publisher.testing)
    return next((name for kind, name in _TOML_KINDS if isinstance(value, kind)), default)


def _toml_repr(value: object) -> str:
    if isinstance(value, str | bool | int | float):
        return json.dumps(value)
    if isinstance(value, list | dict):
        return "[...]" if isinstance(value, list) else "{...}"
    return repr(value)


def _shown(setting: Setting, value: str) -> str:
    if setting.secret and not setting.name.endswith("_url"):
        return "'***'"  # a bare secret, not a URL with a password in it
    return repr(redact(value) if setting.secret else value)


_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass
class ConfigFile:
    """What a TOML config file says: settings by name, and what is wrong with it."""

    values: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: Settings whose value in the file was refused.
    refused: set[str] = field(default_factory=set)


def read_config_file(path: str, only: Collection[str] | None = None) -> ConfigFile:
    """The settings of a TOML file by name, and the problems found in it.

    An unknown key is a problem (with the closest known key as a suggestion):
    a misspelt setting that is silently ignored is worse than a refusal. With
    ``only``, the other settings' keys are skipped, values unread: a command
    that shares the publisher's file judges only what it uses.
    """
    try:
        with Path(path).open("rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        return ConfigFile(problems=[f"config file {path}: cannot be read: {exc.strerror or exc}"])
    except UnicodeDecodeError:
        return ConfigFile(problems=[f"config file {path}: not UTF-8 (TOML files are UTF-8)"])
    except tomllib.TOMLDecodeError as exc:
        return ConfigFile(problems=[f"config file {path}: not valid TOML: {exc}"])
    return _typed(document, f"config file {path}: ", "key", only)


def _typed(
    values: Mapping[str, object], where: str, noun: str, only: Collection[str] | None = None
) -> ConfigFile:
    """Typed values by setting name (a TOML file's, or Python's), each checked against
    its setting's kind (those in ``only``, if given); an unknown name gets the closest
    known one as a suggestion."""
    result = ConfigFile()
    for key, given in values.items():
        setting = _BY_KEY.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, list(_BY_KEY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            result.problems.append(f"{where}unknown {noun} {key!r}{hint}")
            continue
        if only is not None and setting.name not in only:
            continue
        if given is None:  # Python's "not given" (a TOML file has no such value)
            continue
        value = os.fspath(given) if isinstance(given, os.PathLike) else given
        try:
            result.values[setting.name] = _from_file(setting, value)
        except _BadValue as exc:
            shown = '"***"' if setting.secret else _toml_repr(value)
            result.problems.append(f"{where}{key} = {shown} {exc}")
            result.refused.add(setting.name)
    return result


def config_from_values(values: Mapping[str, object]) -> PublisherConfig:
    """A config from Python values by setting name (``publisher.testing``'s keyword
    arguments), validated: ``ConfigError`` names every unknown name, every value of the
    wrong type, and what ``PublisherConfig.problems`` finds."""
    given = _typed(values, "", "setting")
    fields = {"database_url": "", "kafka_bootstrap": "", **given.values}
    config = PublisherConfig(**fields)  # type: ignore[arg-type]  # typed by each Setting.kind
    problems = given.problems + [p.text for p in config.problems() if not p.fields & given.refused]
    if problems:
        raise ConfigError(_heading(problems))
    return config


def resolve(
    flags: Mapping[str, str | bool],
    environ: Mapping[str, str],
    config_file: str | None = None,
    *,
    only: Collection[str] | None = None,
) -> PublisherConfig:
    """Merge the sources, flag > environment > file > default, and validate the result.

    ``flags`` holds only the flags given, by setting name, as text (or the
    value a boolean flag sets). An empty environment variable counts as
    unset. Raises ``ConfigError`` with every problem, one per line: values
    of the wrong type or form from any source, unknown file keys, and what
    ``PublisherConfig.problems`` finds in the merged result. With ``only``,
    the other settings keep their defaults whatever the sources say (a
    command that needs a few of the publisher's settings, such as
    ``outbox-publisher reconcile``).
    """
    file = read_config_file(config_file, only) if config_file else ConfigFile()
    from_file = file.values
    problems = list(file.problems)
    values: dict[str, object] = {}
    bad: set[str] = set()
    for s in SETTINGS:
        if only is not None and s.name not in only:
            continue
        try:
            if s.name in flags and not s.has_flag:
                problems.append(f"{s.name} has no flag (it is a secret): set {s.env}")
                bad.add(s.name)
            elif s.name in flags:
                raw = flags[s.name]
                values[s.name] = raw if isinstance(raw, bool) else _from_text(s, raw)
            elif environ.get(s.env, "").strip():
                values[s.name] = _from_text(s, environ[s.env])
            elif s.name in from_file:
                values[s.name] = from_file[s.name]
            elif s.name in file.refused:
                bad.add(s.name)  # reported with the file's problems
        except _BadValue as exc:
            source = f"{s.flag}" if s.name in flags else s.env
            raw_text = str(flags.get(s.name, environ.get(s.env, "")))
            problems.append(f"{source}={_shown(s, raw_text)}: {exc}")
            bad.add(s.name)
    # A setting whose value was refused is judged no further: its default
    # stands in, and checks that concern it would only repeat the problem.
    values.setdefault("database_url", "")
    values.setdefault("kafka_bootstrap", "")
    config = PublisherConfig(**values)  # type: ignore[arg-type]  # typed by each Setting.kind
    problems += [p.text for p in config.problems() if not p.fields & bad]
    if problems:
        raise ConfigError(_heading(problems))
    return config
