"""How the publisher's Kafka clients authenticate and encrypt: one place, for both libraries.

``KafkaSecurity`` holds the Kafka security settings of a ``PublisherConfig``
(the secrets read from the environment or their files once, at start) and
turns them into what each client library takes: keyword arguments for every
kafka-python client (producer, the reconciler's consumer, the fencer, the
admin clients, the health probe) and properties for librdkafka (the confluent
sink). A client built anywhere else with these settings would be a second
place to forget one.

It also names the producer settings the publisher fixes on purpose
(``acks``, idempotence, transactional ids, in-flight requests, retries,
the timeouts its write deadline is computed from, and security):
``refuse_fixed`` refuses an attempt to override one through a sink's free-form
extras, naming the key.

kafka-python does not tell a refused login from a dropped connection: the
broker answers a wrong SCRAM password by closing the connection, and the
client retries until its bootstrap timeout. ``check_login`` tells them apart
at start (see there), so that a wrong password is one clear line, at once.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaAdminClient
from kafka import errors as kafka_errors
from kafka.net.connection import KafkaConnection

from publisher.config import ConfigError, PublisherConfig, secret_of, tls_context

log = logging.getLogger(__name__)


class KafkaAuthenticationFailed(Exception):
    """The broker refused the publisher's credentials, or the publisher the broker's
    certificate: no waiting will change that."""


@dataclass(frozen=True)
class KafkaSecurity:
    """The Kafka security settings, secrets resolved; ``PLAINTEXT`` by default.

    The secrets are left out of ``repr``, so that a logged or printed
    instance shows none.
    """

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_key_password: str = field(default="", repr=False)
    ssl_check_hostname: bool = True

    @classmethod
    def from_config(cls, config: PublisherConfig) -> KafkaSecurity:
        """The security settings of a validated ``config`` (its validation loaded the TLS
        files: ``kafka_security_problems``); password files are read here."""
        return cls(
            protocol=config.kafka_security_protocol,
            sasl_mechanism=config.kafka_sasl_mechanism,
            sasl_username=config.kafka_sasl_username,
            sasl_password=secret_of(config.kafka_sasl_password, config.kafka_sasl_password_file),
            ssl_cafile=config.kafka_ssl_cafile,
            ssl_certfile=config.kafka_ssl_certfile,
            ssl_keyfile=config.kafka_ssl_keyfile,
            ssl_key_password=secret_of(
                config.kafka_ssl_key_password, config.kafka_ssl_key_password_file
            ),
            ssl_check_hostname=config.kafka_ssl_check_hostname,
        )

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context these settings describe, as kafka-python builds its own
        (``ConfigError`` naming the setting whose file cannot be used)."""
        return tls_context(
            self.ssl_cafile,
            self.ssl_certfile,
            self.ssl_keyfile,
            self.ssl_key_password,
            check_hostname=self.ssl_check_hostname,
        )

    @property
    def sasl(self) -> bool:
        """Whether the clients log in with SASL."""
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @property
    def tls(self) -> bool:
        """Whether the connections are encrypted with TLS."""
        return self.protocol in ("SSL", "SASL_SSL")

    def describe(self) -> str:
        """The protocol, mechanism and user, for logs and errors (no secret)."""
        if self.sasl:
            return f"{self.protocol}, {self.sasl_mechanism} as {self.sasl_username!r}"
        return self.protocol

    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments for any kafka-python client (producer, consumer, admin)."""
        kwargs: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            kwargs["ssl_check_hostname"] = self.ssl_check_hostname
            kwargs["ssl_cafile"] = self.ssl_cafile or None
            kwargs["ssl_certfile"] = self.ssl_certfile or None
            kwargs["ssl_keyfile"] = self.ssl_keyfile or None
            kwargs["ssl_password"] = self.ssl_key_password or None
        if self.sasl:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        return kwargs

    def librdkafka(self) -> dict[str, Any]:
        """Properties for a librdkafka client (the confluent sink)."""
        props: dict[str, Any] = {"security.protocol": self.protocol.lower()}
        if self.tls:
            props["ssl.endpoint.identification.algorithm"] = (
                "https" if self.ssl_check_hostname else "none"
            )
            optional = {
                "ssl.ca.location": self.ssl_cafile,
                "ssl.certificate.location": self.ssl_certfile,
                "ssl.key.location": self.ssl_keyfile,
                "ssl.key.password": self.ssl_key_password,
            }
            props.update({name: value for name, value in optional.items() if value})
        if self.sasl:
            props["sasl.mechanism"] = self.sasl_mechanism
            props["sasl.username"] = self.sasl_username
            props["sasl.password"] = self.sasl_password
        return props


#: No security: what the publisher's clients use unless configured otherwise.
PLAINTEXT = KafkaSecurity()


# --- settings a sink's extras may not override ----------------------------------

#: kafka-python producer arguments the publisher sets itself, and why.
KAFKA_PYTHON_FIXED: Mapping[str, str] = {
    "acks": "every record is confirmed by all in-sync replicas (acks='all')",
    "enable_idempotence": "retries must not write a record twice or out of order",
    "transactional_id": "transactional delivery names its sessions itself (--delivery)",
    "max_in_flight_requests_per_connection": "idempotence keeps order only up to 5 in flight",
    "retries": "a record is retried until its delivery timeout, then settled uncertain",
    "delivery_timeout_ms": "the write deadline is computed from it: use --delivery-timeout-ms",
    "request_timeout_ms": "the write deadline is computed from it: use --request-timeout-ms",
    "max_block_ms": "the write deadline is computed from it: use --max-block-ms",
    "bootstrap_timeout_ms": "finding a broker is bounded by --max-block-ms, as a lookup is",
    "bootstrap_servers": "use --kafka-bootstrap",
    "security_protocol": "use the Kafka security settings (--kafka-security-protocol)",
    "sasl_mechanism": "use the Kafka security settings (--kafka-sasl-mechanism)",
    "sasl_plain_username": "use the Kafka security settings (--kafka-sasl-username)",
    "sasl_plain_password": "use the Kafka security settings (OUTBOX_KAFKA_SASL_PASSWORD)",
    "ssl_context": "use the Kafka security settings (--kafka-ssl-*)",
    "ssl_check_hostname": "use the Kafka security settings (--no-kafka-ssl-check-hostname)",
    "ssl_cafile": "use the Kafka security settings (--kafka-ssl-cafile)",
    "ssl_certfile": "use the Kafka security settings (--kafka-ssl-certfile)",
    "ssl_keyfile": "use the Kafka security settings (--kafka-ssl-keyfile)",
    "ssl_password": "use the Kafka security settings (OUTBOX_KAFKA_SSL_KEY_PASSWORD)",
    "proxy_url": "the connection to the brokers is the Kafka security settings' alone",
}

#: librdkafka properties the publisher sets itself (aliases included), and why.
#: ``message.timeout.ms`` may be shortened, never lengthened (``message_timeout_ms``).
LIBRDKAFKA_FIXED: Mapping[str, str] = {
    **dict.fromkeys(
        ("acks", "request.required.acks", "topic.request.required.acks"),
        "every record is confirmed by all in-sync replicas (acks=all)",
    ),
    "enable.idempotence": "retries must not write a record twice or out of order",
    "transactional.id": "transactional delivery names its sessions itself (--delivery)",
    **dict.fromkeys(
        ("max.in.flight", "max.in.flight.requests.per.connection"),
        "idempotence keeps order only up to 5 in flight",
    ),
    **dict.fromkeys(
        ("retries", "message.send.max.retries"),
        "a record is retried until its delivery timeout, then settled uncertain",
    ),
    "request.timeout.ms": "the write deadline is computed from it: use --request-timeout-ms",
    **dict.fromkeys(("bootstrap.servers", "metadata.broker.list"), "use --kafka-bootstrap"),
    **dict.fromkeys(
        (
            "security.protocol",
            "sasl.mechanism",
            "sasl.mechanisms",
            "sasl.username",
            "sasl.password",
            "ssl.ca.location",
            "ssl.ca.pem",
            "ssl.certificate.location",
            "ssl.certificate.pem",
            "ssl.key.location",
            "ssl.key.pem",
            "ssl.key.password",
            "ssl.endpoint.identification.algorithm",
            "enable.ssl.certificate.verification",
        ),
        "use the Kafka security settings (--kafka-security-protocol, --kafka-sasl-*, "
        "--kafka-ssl-*)",
    ),
    "default.topic.config": "its topic properties would override those the publisher sets "
    "(message.timeout.ms): give each as a property of its own",
}

#: Prefixes of the security settings, all of which the Kafka security settings own: those
#: the publisher supports are set there, and any other (Kerberos, OAuth, cipher lists,
#: revocation lists) would change how it connects behind their back.
_SECURITY_PREFIXES = {
    "kafka-python": ("security_", "sasl_", "ssl_"),
    "librdkafka": ("security.", "sasl.", "ssl.", "ssl_"),
}


def refuse_fixed(extra: Mapping[str, Any], fixed: Mapping[str, str], library: str) -> None:
    """Raise ``ConfigError`` naming every key of ``extra`` that ``fixed`` reserves, and every
    security setting of ``library``."""
    security = _SECURITY_PREFIXES.get(library, ())
    refused = [
        f"{library} setting {key!r} cannot be set through the sink's extras: "
        + fixed.get(key, "use the Kafka security settings (see docs/security.md)")
        for key in extra
        if key in fixed or key.startswith(security)
    ]
    if refused:
        raise ConfigError("invalid Kafka producer settings:\n  " + "\n  ".join(refused))


# --- telling a refused login from an outage ---------------------------------------

#: The last SASL authentication a broker refused, as (monotonic time, reason).
_refusal_lock = threading.Lock()
_last_refusal: tuple[float, str] | None = None


def _note_refusal(reason: str) -> None:
    global _last_refusal  # noqa: PLW0603 - one record per process, as the connections are
    with _refusal_lock:
        _last_refusal = (time.monotonic(), reason)


def refusal_since(start: float) -> str | None:
    """Why a broker refused a SASL login after ``start`` (``time.monotonic()``), if it did."""
    with _refusal_lock:
        if _last_refusal is not None and _last_refusal[0] >= start:
            return _last_refusal[1]
    return None


def _name_sasl_refusals() -> None:
    """Make kafka-python report a login the broker cut off as what it is.

    A broker that refuses a SASL login (a wrong SCRAM password, an unknown
    user) closes the connection; over TLS kafka-python sees only "socket
    disconnected" and retries as for an outage. A connection lost in the
    middle of the SASL exchange is noted here for ``check_login``, which ends
    the command at start with that reason. The error itself is left as it is:
    kafka-python keeps an authentication error per broker and refuses to
    connect to that broker again until a login succeeds, so a connection that
    merely dropped mid-login (a broker restarting) would cut the broker off
    for the life of the process. Applied once, on import.
    """
    original: Callable[..., Any] = KafkaConnection._sasl_authenticate
    if getattr(original, "_outbox_names_refusals", False):
        return
    KafkaConnection._sasl_authenticate = _noting_refusals(original)


def _noting_refusals(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (kafka-python's SASL exchange), noting each refusal it ends with."""

    @functools.wraps(original)
    async def sasl_authenticate(self: Any, timeout_at: float | None = None) -> Any:
        mechanism = self.config.get("sasl_mechanism")
        try:
            return await original(self, timeout_at)
        except kafka_errors.SaslAuthenticationFailedError as exc:
            said = str(exc.args[0] if exc.args else exc).removeprefix(f"{type(exc).__name__}: ")
            _note_refusal(f"the broker refused the {mechanism} login: {said}")
            raise
        except kafka_errors.KafkaConnectionError:
            _note_refusal(
                f"the broker closed the connection during the {mechanism} login "
                "(wrong username or password, or a user without credentials for this mechanism)"
            )
            raise

    sasl_authenticate._outbox_names_refusals = True  # type: ignore[attr-defined]  # a marker
    return sasl_authenticate


_name_sasl_refusals()


@contextmanager
def _quiet_kafka_logs() -> Any:
    """kafka-python logs each failed attempt; ``check_login`` says what matters once."""
    logger = logging.getLogger("kafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_login(bootstrap_servers: str, security: KafkaSecurity, *, timeout_ms: int) -> None:
    """Log in to the cluster once; raise ``KafkaAuthenticationFailed`` if the broker refuses.

    Returns when the login succeeded, and also when no broker answered at
    all within ``timeout_ms``: an unreachable Kafka is an outage that the
    publisher rides out, but refused credentials never get better, so they
    end the command at start with one line that names the cause. Over TLS,
    the handshake is checked first (``check_tls``). Without SASL there is no
    login to check.
    """
    if security.tls and security.ssl_cafile:
        check_tls(bootstrap_servers, security, timeout_ms=timeout_ms)
    if not security.sasl:
        return
    start = time.monotonic()
    deadline = start + timeout_ms / 1000
    while True:
        # Short attempts: a refusal shows within the first, while an attempt
        # runs until its bootstrap timeout however soon the broker refused.
        attempt_ms = max(int(min(_LOGIN_ATTEMPT_MS, (deadline - time.monotonic()) * 1000)), 1)
        try:
            with _quiet_kafka_logs():
                admin = KafkaAdminClient(
                    bootstrap_servers=bootstrap_servers,
                    client_id="outbox-login-check",
                    request_timeout_ms=timeout_ms,
                    bootstrap_timeout_ms=attempt_ms,
                    **security.kafka_python(),
                )
                admin.close()
        except kafka_errors.KafkaError as exc:
            reason = refusal_since(start)
            if reason is not None or isinstance(exc, kafka_errors.SaslAuthenticationFailedError):
                raise KafkaAuthenticationFailed(
                    f"Kafka authentication failed ({security.describe()}): {reason or exc}"
                ) from None
            if time.monotonic() < deadline:
                continue
            log.warning("Kafka did not answer the login check (%s); carrying on", exc)
        return


def check_tls(bootstrap_servers: str, security: KafkaSecurity, *, timeout_ms: int) -> None:
    """Open a TLS session with a bootstrap server; raise ``KafkaAuthenticationFailed``
    when the handshake fails for a reason that waiting cannot change.

    kafka-python logs a failed handshake (a CA that did not sign the broker's
    certificate, a certificate that does not name the host) and retries as
    for a broker that is away, so the publisher would run on as if Kafka were
    down. The servers are tried in turn until one completes a handshake,
    within ``timeout_ms`` in all; one that cannot be reached, or drops the
    connection, is left to the outage path. ``check_login`` asks only when a
    CA file is given: without one, each client library trusts the system's
    CAs as it finds them, which this check could not match for librdkafka.
    """
    context = security.tls_context()
    deadline = time.monotonic() + timeout_ms / 1000
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        host = host.strip("[]")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            with (
                socket.create_connection((host, int(port)), timeout=left) as raw,
                context.wrap_socket(raw, server_hostname=host),
            ):
                return  # a handshake completed: the settings work
        except ssl.SSLCertVerificationError as exc:
            raise KafkaAuthenticationFailed(
                f"Kafka TLS handshake with {host}:{port} failed: {exc.verify_message or exc} "
                "(the broker's certificate is not signed by --kafka-ssl-cafile, or does not "
                "name the host; see docs/security.md)"
            ) from None
        except OSError:
            # Unreachable, or the connection dropped: an outage as far as anyone can
            # tell (a plaintext Kafka listener drops a TLS hello without a word).
            continue


#: How long one login attempt of ``check_login`` may take to find a broker.
_LOGIN_ATTEMPT_MS = 1_000
