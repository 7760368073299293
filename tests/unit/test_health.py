"""Liveness and readiness (publisher/health.py) from what the publisher last saw."""

from __future__ import annotations

import time

from kafka import errors as kafka_errors

from publisher.health import Contact, Health, KafkaProbe
from publisher.metrics import PublisherMetrics
from publisher.service import BackgroundService
from tests.support import wait_until


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _health(clock: FakeClock) -> Health:
    return Health(
        stall_seconds=50, alive_seconds=110, lease_seconds=60, clock=clock, wall=lambda: 1.7e9
    )


def _ready(clock: FakeClock) -> Health:
    """A health record of a publisher that registered, talked to both, and runs its loop."""
    health = _health(clock)
    health.registered = True
    health.database.succeeded()
    health.kafka.succeeded()
    health.loop_started()
    return health


def test_a_running_publisher_whose_dependencies_answered_is_ready() -> None:
    """Registered, last database and Kafka contacts fine, loop turning: ready, every check ok."""
    verdict = _ready(FakeClock()).readiness()
    assert verdict.ok
    assert verdict.checks == {"registered": "ok", "database": "ok", "kafka": "ok", "loop": "ok"}
    assert verdict.as_json()["failing"] == []


def test_a_background_thread_ended_by_a_bug_makes_it_neither_ready_nor_alive() -> None:
    """The heartbeat (or another thread the publisher relies on) ended by an unexpected
    error: its lanes would lapse while the loop turns, so the publisher is not ready, and
    not alive either: only a restart brings the thread back, and an orchestrator restarts
    on liveness alone."""

    class Beating(BackgroundService):
        def run_once(self) -> None:
            """Nothing."""

    health = _ready(FakeClock())
    heartbeat = Beating(name="outbox-heartbeat", interval=1)
    health.threads.append(heartbeat)
    assert health.readiness().ok
    heartbeat.died = RuntimeError("a bug")
    verdict = health.readiness()
    assert not verdict.ok
    assert verdict.checks["threads"] == "thread_died"
    assert verdict.as_json()["failing"] == ["threads"]
    alive = health.liveness()
    assert not alive.ok
    assert alive.checks == {"loop": "ok", "threads": "thread_died"}


def test_a_starting_publisher_is_alive_but_not_ready_and_says_why() -> None:
    """Before registration and any contact, /readyz gives each missing piece's code; /healthz is
    fine."""
    health = _health(FakeClock())
    verdict = health.readiness()
    assert not verdict.ok
    assert verdict.checks == {
        "registered": "not_registered",
        "database": "database_not_contacted",
        "kafka": "kafka_not_contacted",
        "loop": "starting",
    }
    assert health.liveness().ok


def test_a_failed_kafka_contact_makes_it_not_ready_until_a_contact_succeeds() -> None:
    """The last Kafka contact failing gives kafka_unavailable, without its text; a success undoes
    it."""
    clock = FakeClock()
    health = _ready(clock)
    health.kafka.failed(kafka_errors.KafkaConnectionError("111 ECONNREFUSED to kafka-1:9092"))
    clock.now += 2.5
    verdict = health.readiness()
    assert not verdict.ok
    assert verdict.as_json()["failing"] == ["kafka"]
    assert verdict.checks["kafka"] == "kafka_unavailable"
    assert "kafka-1" not in repr(verdict.as_json())
    assert health.kafka.error_type == "KafkaConnectionError"
    health.kafka.succeeded()
    assert health.readiness().ok


def test_a_failed_database_contact_makes_it_not_ready() -> None:
    """The database's last contact failing gives database_unavailable."""
    health = _ready(FakeClock())
    health.database.failed("OperationalError: connection refused")
    verdict = health.readiness()
    assert verdict.as_json()["failing"] == ["database"]
    assert verdict.checks["database"] == "database_unavailable"


def test_a_loop_without_progress_is_not_ready_then_not_alive() -> None:
    """No turn for longer than stall_seconds: not ready; longer than alive_seconds: not alive."""
    clock = FakeClock()
    health = _ready(clock)
    clock.now += 49
    assert health.readiness().ok
    clock.now += 2
    verdict = health.readiness()
    assert verdict.checks["loop"] == "loop_stalled"
    assert health.liveness().ok
    clock.now += 60
    assert not health.liveness().ok
    assert health.liveness().checks["loop"] == "loop_stalled"
    health.loop_turned()
    assert health.liveness().ok
    assert health.readiness().ok


def test_a_loop_is_stuck_only_while_running_and_past_the_stall_limit() -> None:
    """Starting or ended is not stuck; running and unturned for stall_seconds is."""
    clock = FakeClock()
    health = _health(clock)
    clock.now += 500
    assert not health.loop_stuck()  # still starting
    health.loop_started()
    clock.now += 50
    assert not health.loop_stuck()
    clock.now += 1
    assert health.loop_stuck()
    health.loop_turned()
    assert not health.loop_stuck()
    clock.now += 100
    health.loop_ended()
    assert not health.loop_stuck()


def test_a_stopping_publisher_is_not_ready_and_an_ended_loop_is_not_alive() -> None:
    """After a stop request /readyz says stopping; once the loop ended /healthz fails."""
    health = _ready(FakeClock())
    health.stopping = True
    assert health.readiness().checks["loop"] == "stopping"
    assert health.liveness().ok
    health.loop_ended()
    assert not health.liveness().ok
    assert health.liveness().checks == {"loop": "loop_ended"}


def test_the_kafka_probe_asks_only_when_nothing_talked_to_kafka_lately() -> None:
    """The probe checks at once when Kafka was never contacted, then only once contacts age."""
    clock = FakeClock()
    health = _health(clock)
    calls: list[float] = []
    probe = KafkaProbe(health.kafka, lambda: calls.append(clock.now), interval=10)

    assert probe.run_once()
    assert health.kafka.ok is True
    clock.now += 5
    assert not probe.run_once()
    clock.now += 6
    assert probe.run_once()
    assert calls == [1_000.0, 1_011.0]


def test_the_kafka_probe_records_a_failure_with_its_reason() -> None:
    """A check that raises marks Kafka as failed, keeping the error's class, not its text."""
    clock = FakeClock()
    health = _ready(clock)
    clock.now += 30

    def refuse() -> None:
        raise kafka_errors.KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1")

    probe = KafkaProbe(health.kafka, refuse, interval=10)
    assert probe.run_once()
    assert health.kafka.ok is False
    assert health.kafka.error_type == "KafkaTimeoutError"
    assert health.readiness().checks["kafka"] == "kafka_unavailable"


def test_the_kafka_probe_thread_probes_at_start_and_stops_promptly() -> None:
    """start() probes in a thread; stop() returns without waiting out the interval."""
    health = _health(FakeClock())
    probe = KafkaProbe(health.kafka, lambda: None, interval=3_600)
    probe.start()
    try:
        wait_until(lambda: health.kafka.ok, timeout=5, what="the first probe")
    finally:
        started = time.monotonic()
        probe.stop()
    assert time.monotonic() - started < 5


def test_a_broker_that_refuses_the_publisher_keeps_it_unready_whatever_the_probe_hears() -> None:
    """A refused TransactionalId (or cluster right, or login) is kafka_refused: the probe's
    cluster description, which anyone may ask, shows the broker up (outbox_kafka_up) but does
    not make the publisher ready; only a contact of its own that succeeds does."""
    clock = FakeClock()
    health = _ready(clock)
    health.kafka.failed(kafka_errors.TransactionalIdAuthorizationFailedError("denied"))
    assert health.readiness().checks["kafka"] == "kafka_refused"
    clock.now += 30
    probe = KafkaProbe(health.kafka, lambda: None, interval=10)
    assert probe.run_once()
    assert health.kafka.ok is True
    assert health.readiness().checks["kafka"] == "kafka_refused"
    health.kafka.failed(kafka_errors.KafkaTimeoutError("no broker"))  # then an outage
    assert health.readiness().checks["kafka"] == "kafka_refused"
    health.kafka.succeeded()  # a lookup or a send went through: granted
    assert health.readiness().ok
    health.kafka.failed(kafka_errors.KafkaTimeoutError("no broker"))
    assert health.readiness().checks["kafka"] == "kafka_unavailable"


def test_a_contact_says_how_long_it_has_failed_since_its_last_success() -> None:
    """From the first failure after a success; a success ends it; never contacted: None."""
    now = [100.0]
    contact = Contact("kafka", lambda: now[0], lambda: 0.0)
    assert contact.failing_for() is None
    contact.failed("refused")
    now[0] = 130.0
    contact.failed("refused again")
    assert contact.failing_for() == 30.0
    contact.succeeded()
    assert contact.failing_for() is None


def test_writes_failing_for_a_lease_make_it_not_ready_while_the_probe_hears_the_broker() -> None:
    """The brokers answer the idle probe's questions, but no write has gone through for a
    lease (the heartbeat's step-back limit): kafka_writes_failing, and the gauge says for
    how long; outbox_kafka_up stays 1 (the broker answers). A write that goes through
    ends it."""
    clock = FakeClock()
    health = _ready(clock)
    metrics = PublisherMetrics(health)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    assert sample("outbox_kafka_writes_failing_seconds") == 0
    health.kafka.failed(kafka_errors.KafkaTimeoutError("Expiring 500 record(s) for orders-0"))
    assert health.readiness().checks["kafka"] == "kafka_unavailable"
    probe = KafkaProbe(health.kafka, lambda: None, interval=10)
    clock.now += 12
    health.loop_turned()
    assert probe.run_once()  # describe_cluster answers
    assert health.readiness().ok
    clock.now += 47  # 59 s of failed writes
    health.loop_turned()
    assert health.readiness().ok
    clock.now += 1
    assert probe.run_once()
    verdict = health.readiness()
    assert not verdict.ok
    assert verdict.checks["kafka"] == "kafka_writes_failing"
    assert verdict.as_json()["failing"] == ["kafka"]
    assert sample("outbox_ready") == 0
    assert sample("outbox_kafka_up") == 1
    assert sample("outbox_kafka_writes_failing_seconds") == 60
    clock.now += 600
    health.loop_turned()
    assert probe.run_once()
    assert health.readiness().checks["kafka"] == "kafka_writes_failing"
    assert sample("outbox_kafka_writes_failing_seconds") == 660
    health.kafka.succeeded()  # a record confirmed
    assert health.readiness().ok
    assert sample("outbox_kafka_writes_failing_seconds") == 0


def test_a_publisher_with_nothing_to_write_is_not_failing_writes() -> None:
    """A write failed (its message became uncertain, and the reconciler decided it since),
    then nothing more to write: however long no write comes, its writes are not failing,
    and the gauge says 0. Something to write again, the run counts again."""
    clock = FakeClock()
    health = _ready(clock)
    metrics = PublisherMetrics(health)
    health.kafka.failed(kafka_errors.KafkaTimeoutError("Expiring 1 record(s) for orders-0"))
    probe = KafkaProbe(health.kafka, lambda: None, interval=10)
    health.writes_wanted = False  # its claims find nothing
    clock.now += 600
    health.loop_turned()
    assert probe.run_once()
    assert health.readiness().ok
    assert metrics.registry.get_sample_value("outbox_kafka_writes_failing_seconds") == 0
    health.writes_wanted = True
    assert health.readiness().checks["kafka"] == "kafka_writes_failing"


def test_an_idle_publisher_whose_probe_failed_once_is_ready_again_when_it_answers() -> None:
    """A question of the idle probe that went unanswered (a broker restarting) starts no run
    of failed writes: the next answer ends it, however long no write comes after; once a
    write has failed in the run, an answer no longer ends it."""
    clock = FakeClock()
    health = _ready(clock)
    answers = [kafka_errors.KafkaTimeoutError("no broker"), None, None]

    def check() -> None:
        error = answers.pop(0)
        if error is not None:
            raise error

    probe = KafkaProbe(health.kafka, check, interval=10)
    clock.now += 10
    assert probe.run_once()
    assert health.readiness().checks["kafka"] == "kafka_unavailable"
    clock.now += 10
    assert probe.run_once()
    assert health.kafka.failing_for() is None
    clock.now += 600
    health.loop_turned()
    assert probe.run_once()
    assert health.readiness().ok
    health.kafka.unanswered(kafka_errors.KafkaTimeoutError("no broker"))
    health.kafka.failed(kafka_errors.KafkaTimeoutError("Expiring 1 record(s)"))
    health.kafka.answered()
    assert health.kafka.failing_for() == 0


def test_without_a_lease_failing_writes_never_fail_readiness() -> None:
    """A health record not told the lease (a test's, an embedding's) keeps readiness to the
    last contact."""
    clock = FakeClock()
    health = Health(stall_seconds=50, alive_seconds=110, clock=clock)
    health.registered = True
    health.database.succeeded()
    health.loop_started()
    health.kafka.failed(kafka_errors.KafkaTimeoutError("Expiring 1 record(s)"))
    health.kafka.answered()
    clock.now += 3_600
    health.loop_turned()
    assert health.kafka.failing_for() == 3_600
    assert health.readiness().ok
