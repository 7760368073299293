"""The publisher's log lines: text for people, JSON for log collectors, context on both.

Every line about a message names the message, its attempt and its fence (and
the batch where known): in text they lead the line ("message <id> attempt 3
fence 7: ..."), in JSON they are also fields of their own, so that a log
search for one message id finds its whole story. ``MessageLog`` adds both;
``JsonFormatter`` writes one object per line with every such field.
"""

from __future__ import annotations

import copy
import json
import logging
import ssl
import sys
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any, TextIO

from publisher.socket_guard import WriteDeadlinePassed

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the context fields.

    Context fields are whatever the call passed with ``extra=`` (``message_id``,
    ``attempt``, ``fence``, ``batch_id``...); values JSON cannot hold are
    written as text. A traceback goes to ``exception``.
    """

    def format(self, record: logging.LogRecord) -> str:
        """Render one record as a single line of JSON."""
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _RECORD_ATTRIBUTES and not name.startswith("_"):
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def message_context(
    message_id: uuid.UUID,
    *,
    attempt: int | None = None,
    fence: int | None = None,
    batch_id: int | None = None,
) -> dict[str, object]:
    """The context fields of a line about one message (unknown ones left out)."""
    context: dict[str, object] = {"message_id": str(message_id)}
    for name, value in (("attempt", attempt), ("fence", fence), ("batch_id", batch_id)):
        if value is not None:
            context[name] = value
    return context


class MessageLog(logging.LoggerAdapter[logging.Logger]):
    """A logger for lines about one message: prefixes the text, adds the context fields.

    ``MessageLog(log, m.id, attempt=3, fence=7, batch_id=12).warning("will retry")``
    logs "message <id> attempt 3 fence 7: will retry" with ``message_id``,
    ``attempt``, ``fence`` and ``batch_id`` as fields.
    """

    def __init__(
        self,
        logger: logging.Logger,
        message_id: uuid.UUID,
        *,
        attempt: int | None = None,
        fence: int | None = None,
        batch_id: int | None = None,
    ) -> None:
        context = message_context(message_id, attempt=attempt, fence=fence, batch_id=batch_id)
        super().__init__(logger, context)
        words = [f"message {message_id}"]
        if attempt is not None:
            words.append(f"attempt {attempt}")
        if fence is not None:
            words.append(f"fence {fence}")
        self.prefix = " ".join(words)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefix the message and merge the context into the call's own ``extra``."""
        own: Mapping[str, object] = kwargs.get("extra") or {}
        kwargs["extra"] = {**(self.extra or {}), **own}
        return f"{self.prefix}: {msg}", kwargs


class Outage:
    """The log lines of one dependency's outage, however many tries it lasts.

    A loop that tries again every second would log a line a second for as long
    as the dependency is away. Here the first failure is a WARNING ("<what>
    (<error>); retrying"), a failure that says something else is one at once,
    and the same failure again only every ``every`` seconds, with how long it
    has lasted and how many tries. Once it has lasted ``loud_after`` seconds,
    one ERROR line says so and what to check (``hint``): an alert on ERROR
    lines then fires for an outage that does not end by itself, a password
    refused or a database that does not exist, and not for a restart. The
    first success after failures says how long it lasted (INFO).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        hint: str,
        every: float = 60.0,
        loud_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.what = what
        self.hint = hint
        self.every = every
        self.loud_after = loud_after
        self._clock = clock
        #: When the outage began, and when a line last said it (None: no outage).
        self._began: float | None = None
        self._said_at = 0.0
        self._said = ""
        self._loud = False
        #: Failures since the outage began.
        self.tries = 0

    def failed(self, error: BaseException) -> None:
        """One more failed try."""
        now = self._clock()
        text = str(error).strip() or type(error).__name__
        if self._began is None:
            self._began, self.tries, self._loud = now, 0, False
        self.tries += 1
        lasted = now - self._began
        if not self._loud and lasted >= self.loud_after:
            self._loud = True
            self._log.error(
                "%s for %.0fs (%d tries): %s; still retrying. %s",
                self.what, lasted, self.tries, text, self.hint,
            )  # fmt: skip
        elif self.tries == 1 or text != self._said:
            self._log.warning("%s (%s); retrying", self.what, text)
        elif now - self._said_at >= self.every:
            self._log.warning(
                "%s for %.0fs (%d tries): %s; retrying", self.what, lasted, self.tries, text
            )
        else:
            return
        self._said, self._said_at = text, now

    def ended(self) -> None:
        """A try succeeded: an outage, if there was one, is over."""
        if self._began is None:
            return
        self._log.info(
            "%s: over after %.0fs (%d failed tries)",
            self.what, self._clock() - self._began, self.tries,
        )  # fmt: skip
        self._began = None


class _Fields(logging.Filter):
    """Adds fixed fields (the publisher id) to every record that lacks them."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        super().__init__()
        self._fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the fields; never drops a record."""
        for name, value in self._fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


#: kafka-python's ERROR lines about a connection or request it retries, by their
#: templates (kafka-python 3.0: kafka/net/transport.py, connection.py and
#: manager.py, kafka/producer/sender.py). Any other line keeps its level: a
#: crashed I/O loop, a SASL handshake refused, a proxy, a fatal producer error.
_RETRIED_BY_KAFKA_PYTHON = frozenset(
    {
        "%s: socket disconnected",
        "%s: Error receiving network data closing socket",
        "%s: Error sending request data: %s",
        "%s: Abort (%s)",
        "Connection failed: %s",
        "%s: Connection lost: %s",
        "%s: Error sending produce request to node %d: %s",
    }
)
#: Words of a librdkafka broker failure (facility ``FAIL``) about security: a login
#: or TLS handshake refused keeps its level, as does a wrong ``security.protocol``.
_SECURITY_WORDS = ("sasl", "ssl", "tls", "authenticat", "certificate", "security.protocol")


def _tls_refusal(error: BaseException) -> bool:
    """Whether ``error``, or one it was raised from, is a TLS handshake that failed
    (kafka-python reports a certificate refused as a retriable connection error)."""
    seen: BaseException | None = error
    for _ in range(8):  # a cause chain is short; a cycle must not loop for ever
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) or "Handshake failed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _retried(error: BaseException) -> bool:
    """An error the producer client retries by itself: a network one or one kafka-python
    marks retriable (a connection lost or refused, a request timed out, a leader moved),
    but not a TLS handshake refused; or the publisher's own abort of a request past its
    batch's write deadline (``WriteDeadlinePassed``)."""
    if isinstance(error, WriteDeadlinePassed):
        return True
    if _tls_refusal(error):
        return False
    return isinstance(error, OSError) or getattr(error, "retriable", False) is True


def _about_a_retried_connection(record: logging.LogRecord) -> bool:
    """Whether an ERROR line of a producer library is about a connection or request it
    retries: one of kafka-python's ``_RETRIED_BY_KAFKA_PYTHON`` with only retried errors
    attached, or librdkafka's broker failure (facility ``FAIL``) not about security."""
    args = record.args if isinstance(record.args, tuple) else ()
    if record.name == "publisher.librdkafka":
        # confluent-kafka logs librdkafka's lines as ("%s [%s] %s", facility, name, text).
        return (
            len(args) == 3
            and args[0] == "FAIL"
            and not any(word in str(args[2]).lower() for word in _SECURITY_WORDS)
        )
    if not record.name.startswith("kafka.") or record.msg not in _RETRIED_BY_KAFKA_PYTHON:
        return False
    if record.exc_info and record.exc_info[1] is not None:
        errors: list[BaseException] = [record.exc_info[1]]
    else:
        errors = [arg for arg in args if isinstance(arg, BaseException)]
    return all(_retried(error) for error in errors)


def _as_shown(record: logging.LogRecord, threshold: int) -> logging.LogRecord | None:
    """The record as the publisher's handler shows it, or None when it is not shown.

    A producer library's ERROR line about a connection or request it retries is
    shown at WARNING (if the configured level shows warnings), its traceback
    folded into the line: a broker that restarts or loses its leadership makes
    kafka-python log a few dozen such lines per publisher, some with a
    traceback of its socket code, and librdkafka one per failed connection.
    What they did to messages, if anything, is in the publisher's own lines
    (an outage, uncertain, quarantined), which keep their level, so an alert on
    ERROR means a message or a fault. Anything else, a TLS handshake, an
    authentication or authorization error or a fault in the client included,
    keeps its level and its traceback. A copy is changed: other handlers get the record as
    logged. Never raises: a record it cannot read is shown as it is.
    """
    try:
        if record.levelno != logging.ERROR or not _about_a_retried_connection(record):
            return record
        if threshold > logging.WARNING:
            return None
        shown = copy.copy(record)
        shown.levelno, shown.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            said = str(error)
            if type(error).__name__ not in said:  # kafka-python's errors name themselves
                said = f"{type(error).__name__}: {said}"
            shown.msg, shown.args = f"{record.getMessage()} ({said})", None
            shown.exc_info = shown.exc_text = None
        return shown
    except Exception:  # noqa: BLE001 - a log line must never fail the code that logs it
        return record


class _PublisherHandler(logging.StreamHandler[TextIO]):
    """The publisher's one log handler: every line, with the producer libraries' lines
    about connections they retry lowered (``_as_shown``) and held to its level again."""

    def handle(self, record: logging.LogRecord) -> bool:
        """Emit the record as ``_as_shown`` has it (nothing when it is not shown)."""
        shown = _as_shown(record, self.level)
        return False if shown is None else bool(super().handle(shown))


def configure_logging(
    level: str,
    log_format: str,
    stream: TextIO | None = None,
    *,
    fields: Mapping[str, object] | None = None,
) -> None:
    """Send every log line to ``stream`` (stderr) at ``level``, as text or JSON.

    ``fields`` are added to every line (in JSON only: text lines stay short),
    so that lines of several publishers collected together can be told apart.
    kafka-python logs every reconnect at INFO/ERROR and an ERROR for each
    topic it has not seen yet (even one the broker creates on first use);
    the publisher's own lines say what matters, so those are quietened: its
    INFO lines are not shown, and its ERROR lines about connections and
    requests it retries are shown at WARNING, as are librdkafka's (``_as_shown``).
    """
    root = logging.getLogger()
    root.setLevel(level)
    handler = _PublisherHandler(stream or sys.stderr)
    handler.setLevel(root.level)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    if fields:
        handler.addFilter(_Fields(fields))
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.getLogger("kafka").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.getLogger("kafka.cluster").setLevel(logging.CRITICAL)
