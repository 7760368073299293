"""Log lines (publisher/logs.py): JSON objects, message context, text prefixes."""

from __future__ import annotations

import io
import json
import logging
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    RequestTimedOutError,
    SaslAuthenticationFailedError,
)

from publisher.logs import JsonFormatter, MessageLog, Outage, configure_logging
from publisher.socket_guard import WriteDeadlinePassed

MESSAGE_ID = uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the root logger's handlers and level back after a test that configures logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("publisher.loop", logging.WARNING, __file__, 1, msg, args, None)
    for name, value in extra.items():
        setattr(record, name, value)
    record.created = 1_700_000_000.25
    return record


def test_json_formatter_writes_one_object_with_time_level_logger_message_and_context() -> None:
    """A record becomes one line of JSON holding the standard fields and every extra field."""
    line = JsonFormatter().format(
        _record("sent %d records", 3, message_id=str(MESSAGE_ID), attempt=2, fence=5, batch_id=9)
    )
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2023-11-14T22:13:20.250+00:00",
        "level": "WARNING",
        "logger": "publisher.loop",
        "message": "sent 3 records",
        "message_id": str(MESSAGE_ID),
        "attempt": 2,
        "fence": 5,
        "batch_id": 9,
    }


def test_json_formatter_writes_values_json_cannot_hold_as_text_and_tracebacks() -> None:
    """A UUID field is written as text; an exception goes to "exception" with its traceback."""
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "publisher",
            logging.ERROR,
            __file__,
            1,
            "failed",
            (),
            exc_info=sys.exc_info(),
        )
    record.publisher_id = MESSAGE_ID
    parsed = json.loads(JsonFormatter().format(record))
    assert parsed["publisher_id"] == str(MESSAGE_ID)
    assert parsed["exception"].startswith("Traceback")
    assert "ValueError: boom" in parsed["exception"]


def test_message_log_prefixes_the_text_and_adds_the_context_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Text says "message <id> attempt A fence F: ..."; the record carries each as a field."""
    logger = logging.getLogger("publisher.test")
    with caplog.at_level(logging.INFO, logger="publisher.test"):
        MessageLog(logger, MESSAGE_ID, attempt=3, fence=7, batch_id=12).warning(
            "not written, will retry: %s", "KafkaTimeoutError", extra={"topic": "orders"}
        )
    (record,) = caplog.records
    assert record.getMessage() == (
        f"message {MESSAGE_ID} attempt 3 fence 7: not written, will retry: KafkaTimeoutError"
    )
    assert record.message_id == str(MESSAGE_ID)  # type: ignore[attr-defined]
    assert (record.attempt, record.fence, record.batch_id) == (3, 7, 12)  # type: ignore[attr-defined]
    assert record.topic == "orders"  # type: ignore[attr-defined]


def test_message_log_leaves_out_what_is_not_known(caplog: pytest.LogCaptureFixture) -> None:
    """Without attempt and fence (recovery knows only the id), nothing is invented."""
    logger = logging.getLogger("publisher.test")
    with caplog.at_level(logging.INFO, logger="publisher.test"):
        MessageLog(logger, MESSAGE_ID).warning("lease expired, moved to %s", "pending")
    (record,) = caplog.records
    assert record.getMessage() == f"message {MESSAGE_ID}: lease expired, moved to pending"
    assert not hasattr(record, "attempt")
    assert not hasattr(record, "fence")


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_json_puts_fixed_fields_on_every_line() -> None:
    """--log-format json: each line is an object, with the publisher id and the message context."""
    stream = io.StringIO()
    configure_logging("INFO", "json", stream, fields={"publisher_id": "p-1"})
    logger = logging.getLogger("publisher.loop")
    logger.info("publisher started")
    MessageLog(logger, MESSAGE_ID, attempt=1, fence=1, batch_id=4).error("quarantined: too large")
    logger.debug("not shown at INFO")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "publisher started"
    assert first["publisher_id"] == "p-1"
    assert second["level"] == "ERROR"
    assert second["message"] == f"message {MESSAGE_ID} attempt 1 fence 1: quarantined: too large"
    assert (second["message_id"], second["attempt"], second["fence"], second["batch_id"]) == (
        str(MESSAGE_ID),
        1,
        1,
        4,
    )
    assert second["publisher_id"] == "p-1"


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_text_writes_the_context_in_the_message() -> None:
    """--log-format text: one human line, the message's id, attempt and fence in its text."""
    stream = io.StringIO()
    configure_logging("WARNING", "text", stream, fields={"publisher_id": "p-1"})
    MessageLog(logging.getLogger("publisher.loop"), MESSAGE_ID, attempt=3, fence=7).warning("stale")
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(f"WARNING publisher.loop: message {MESSAGE_ID} attempt 3 fence 7: stale")
    assert "p-1" not in line


def _logged_with_traceback(logger: str, template: str, error: BaseException) -> None:
    """Log ``error`` with its traceback, as kafka-python does (its object as the ``%s``)."""
    try:
        raise error
    except BaseException:
        if template.count("%s"):
            logging.getLogger(logger).exception(template, "<client>")
        else:
            logging.getLogger(logger).exception(template)


@pytest.mark.usefixtures("restore_logging")
def test_errors_the_producer_client_retries_are_warnings_in_one_line() -> None:
    """A broker restart makes kafka-python log ERROR lines (some with a traceback of its
    socket code) and librdkafka one per failed connection: shown at WARNING, the exception
    in the line. Everything else keeps its level and traceback: the publisher's own lines,
    a TLS handshake or login refused, a fault in the client, a CRITICAL line. The
    templates are kafka-python 3.0's own."""
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    reset = ConnectionResetError(104, "Connection reset by peer")
    _logged_with_traceback(
        "kafka.net.transport", "%s: Error receiving network data closing socket", reset
    )
    net = logging.getLogger("kafka.net.connection")
    logging.getLogger("kafka.net.manager").error(
        "Connection failed: %s", KafkaConnectionError("111")
    )
    logging.getLogger("kafka.net.transport").error("%s: socket disconnected", "<transport>")
    logging.getLogger("kafka.producer.sender").error(
        "%s: Error sending produce request to node %d: %s", "<sender>", 2,
        RequestTimedOutError("after 30000 ms"),
    )  # fmt: skip
    logging.getLogger("kafka.net.transport").error(
        "%s: Abort (%s)", "<transport>", WriteDeadlinePassed("nothing more written")
    )
    logging.getLogger("publisher.librdkafka").error(
        "%s [%s] %s", "FAIL", "rdkafka#producer-1", "127.0.0.1:9092/1: Connect failed: refused"
    )
    handshake = KafkaConnectionError("Handshake failed: certificate verify failed")
    kept: dict[str, Callable[[], None]] = {
        "own": lambda: logging.getLogger("publisher.loop").error("message x: quarantined"),
        "login": lambda: net.error(
            "%s: Connection lost: %s", "<conn>", SaslAuthenticationFailedError("wrong password")
        ),
        "tls": lambda: net.error("%s: Connection lost: %s", "<conn>", handshake),
        "sasl handshake": lambda: net.error(
            "%s: SaslHandshake failed: %s", "<conn>", "UnsupportedSaslMechanismError"
        ),
        "fault": lambda: _logged_with_traceback(
            "kafka.producer.sender",
            "%s: Uncaught error in kafka producer I/O thread",
            KafkaTimeoutError("x"),
        ),
        "crashed loop": lambda: _logged_with_traceback(
            "kafka.net.selector", "IO loop crashed (client_id=%s)", OSError(24, "Too many files")
        ),
        "critical": lambda: logging.getLogger("kafka.net.transport").critical("bad"),
        "librdkafka login": lambda: logging.getLogger("publisher.librdkafka").error(
            "%s [%s] %s", "FAIL", "rdkafka#1", "SASL authentication failure: wrong password"
        ),
        "librdkafka, not a connection": lambda: logging.getLogger("publisher.librdkafka").error(
            "%s [%s] %s", "ERROR", "rdkafka#1", "other"
        ),
    }
    for log in kept.values():
        log()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    lowered, rest = lines[:6], lines[6:]
    assert [line["level"] for line in lowered] == ["WARNING"] * 6
    assert all("exception" not in line for line in lowered)
    assert lowered[0]["message"] == (
        "<client>: Error receiving network data closing socket "
        "(ConnectionResetError: [Errno 104] Connection reset by peer)"
    )
    assert lowered[3]["message"] == (
        "<sender>: Error sending produce request to node 2: [Error 7] RequestTimedOutError: "
        "after 30000 ms"
    )
    assert [line["level"] for line in rest] == [
        "ERROR", "ERROR", "ERROR", "ERROR", "ERROR", "ERROR", "CRITICAL", "ERROR", "ERROR"
    ]  # fmt: skip
    assert all("Traceback" in rest[i]["exception"] for i in (4, 5))


@pytest.mark.usefixtures("restore_logging")
def test_a_lowered_line_is_hidden_below_its_new_level_and_other_handlers_get_it_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--log-level ERROR hides what is lowered to WARNING, as it hides the publisher's own
    warnings; a handler of the application's own (an alert) still gets the ERROR."""
    stream = io.StringIO()
    configure_logging("ERROR", "text", stream)
    logging.getLogger().addHandler(caplog.handler)
    _logged_with_traceback(
        "kafka.net.transport",
        "%s: Error receiving network data closing socket",
        ConnectionResetError(104, "reset"),
    )
    logging.getLogger("publisher.loop").error("message x: quarantined")
    (line,) = stream.getvalue().splitlines()
    assert line.endswith("ERROR publisher.loop: message x: quarantined")
    [original, _] = caplog.records
    assert (original.levelname, original.exc_info is not None) == ("ERROR", True)


@pytest.mark.usefixtures("restore_logging")
def test_a_client_line_that_cannot_be_formatted_does_not_raise_into_the_client() -> None:
    """Logging never raises into the code that logs (logging reports the bad call itself)."""
    configure_logging("INFO", "text", io.StringIO())
    logging.raiseExceptions, before = False, logging.raiseExceptions
    try:
        bad = logging.getLogger("kafka.net.transport")
        bad.error("%s: Connection lost: %s", "one argument for two")  # as a library may
    finally:
        logging.raiseExceptions = before


def test_an_outage_is_logged_once_then_every_minute_then_as_an_error_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A try a second for two minutes gives a handful of lines, not 120: the first failure,
    each change of what the failure says, a reminder a minute, one ERROR once it has
    lasted a minute, and one line when it is over."""
    now = [0.0]
    outage = Outage(
        logging.getLogger("outage-test"), "database unavailable", hint="Check it.",
        clock=lambda: now[0],
    )  # fmt: skip
    refused = OSError("connection refused")
    caplog.set_level(logging.INFO, logger="outage-test")
    for second in range(30):
        now[0] = float(second)
        outage.failed(refused)
    now[0] = 30.0
    outage.failed(OSError("the database system is starting up"))
    for second in range(31, 121):
        now[0] = float(second)
        outage.failed(refused)
    now[0] = 121.0
    outage.ended()
    outage.ended()  # no outage: nothing to say

    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("WARNING", "database unavailable (connection refused); retrying"),
        ("WARNING", "database unavailable (the database system is starting up); retrying"),
        ("WARNING", "database unavailable (connection refused); retrying"),
        (
            "ERROR",
            "database unavailable for 60s (61 tries): connection refused; still retrying. "
            "Check it.",
        ),
        ("WARNING", "database unavailable for 120s (121 tries): connection refused; retrying"),
        ("INFO", "database unavailable: over after 121s (121 failed tries)"),
    ]
    # A new outage starts its own count, and is loud again after its own minute.
    caplog.clear()
    for second in range(200, 261):
        now[0] = float(second)
        outage.failed(refused)
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
