"""The local broker's SASL_SSL listener, as ``services/up`` describes it in ``.services.env``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from publisher.kafka_security import KafkaSecurity

#: The variables ``services/up`` exports for its SASL_SSL listener.
SECURE_VARS = (
    "OUTBOX_SECURE_KAFKA_BOOTSTRAP",
    "OUTBOX_SECURE_KAFKA_CAFILE",
    "OUTBOX_SECURE_KAFKA_MECHANISM",
    "OUTBOX_SECURE_KAFKA_USERNAME",
    "OUTBOX_SECURE_KAFKA_PASSWORD_FILE",
)


@dataclass(frozen=True)
class SecureKafka:
    """Where the SASL_SSL listener is, its CA, and the SCRAM user to log in as."""

    bootstrap: str
    cafile: str
    mechanism: str
    username: str
    password_file: str

    @classmethod
    def from_env(cls, env: dict[str, str]) -> SecureKafka | None:
        """The listener the variables describe, or ``None`` when they are not all set."""
        values = [env.get(name, "") for name in SECURE_VARS]
        return cls(*values) if all(values) else None

    @property
    def password(self) -> str:
        """The SCRAM user's password (tests check that no output repeats it)."""
        return Path(self.password_file).read_text().strip()

    def publisher_env(self, *, password: str | None = None) -> dict[str, str]:
        """The publisher's environment for this listener; the password from its file, or
        ``password`` in OUTBOX_KAFKA_SASL_PASSWORD."""
        env = {
            "OUTBOX_KAFKA_BOOTSTRAP": self.bootstrap,
            "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "OUTBOX_KAFKA_SASL_MECHANISM": self.mechanism,
            "OUTBOX_KAFKA_SASL_USERNAME": self.username,
            "OUTBOX_KAFKA_SSL_CAFILE": self.cafile,
        }
        if password is None:
            env["OUTBOX_KAFKA_SASL_PASSWORD_FILE"] = self.password_file
        else:
            env["OUTBOX_KAFKA_SASL_PASSWORD"] = password
        return env

    def security(self, *, password: str | None = None) -> KafkaSecurity:
        """The clients' settings for this listener (the right password unless told another)."""
        return KafkaSecurity(
            protocol="SASL_SSL",
            sasl_mechanism=self.mechanism,
            sasl_username=self.username,
            sasl_password=self.password if password is None else password,
            ssl_cafile=self.cafile,
        )
