"""KafkaLogScanner.offset_range: which answers it asks again, and for how long.

The admin client is replaced by a scripted one: whether kafka-python's admin
client finds a moved leader is shown against a real cluster
(tests/integration/test_leader_moves.py); these tests pin the scanner's own
policy.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kafka import TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import OffsetSpec
from kafka.structs import OffsetAndTimestamp

import publisher.scanner as scanner_module
from publisher.scanner import KafkaLogScanner
from tests.support import wait_until


class ScriptedAdmin:
    """Answers list_partition_offsets from a script: an exception to raise, or an offset."""

    def __init__(self, script: list[BaseException | int]) -> None:
        self.script = script
        self.asked: list[tuple[OffsetSpec, str]] = []
        self.built = 0
        self.closed = 0

    def __call__(self, **_config: Any) -> ScriptedAdmin:  # stands in for the class
        self.built += 1
        return self

    def list_partition_offsets(
        self, specs: dict[TopicPartition, OffsetSpec], *, isolation_level: str, timeout_ms: int
    ) -> dict[TopicPartition, OffsetAndTimestamp]:
        assert 0 < timeout_ms <= scanner_module.OFFSET_LOOKUP_SECONDS * 1000
        ((tp, spec),) = specs.items()
        self.asked.append((spec, isolation_level))
        step = self.script.pop(0) if self.script else 0
        if isinstance(step, BaseException):
            raise step
        return {tp: OffsetAndTimestamp(step, -1, None)}

    def close(self) -> None:
        self.closed += 1


def scanner_with(admin: ScriptedAdmin, monkeypatch: pytest.MonkeyPatch) -> KafkaLogScanner:
    monkeypatch.setattr(scanner_module, "_AdminClient", admin)
    return KafkaLogScanner("127.0.0.1:9")


def test_a_leader_that_cannot_tell_its_offsets_yet_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A partition's new leader answers OFFSET_NOT_AVAILABLE until its high
    # watermark has caught up (a few hundred ms); NOT_LEADER while the
    # election is under way.
    admin = ScriptedAdmin(
        [
            kafka_errors.OffsetNotAvailableError(),
            kafka_errors.NotLeaderForPartitionError(),
            4,
            kafka_errors.OffsetNotAvailableError(),
            4,
            17,
        ]
    )
    scanner = scanner_with(admin, monkeypatch)

    assert scanner.offset_range("t", 0, committed=True) == (4, 17)
    assert all(level == "read_committed" for _, level in admin.asked)
    assert [spec for spec, _ in admin.asked][-2:] == [OffsetSpec.EARLIEST, OffsetSpec.LATEST]


def test_an_answer_that_will_not_change_is_raised_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = ScriptedAdmin([kafka_errors.TopicAuthorizationFailedError(), 0, 9])
    scanner = scanner_with(admin, monkeypatch)

    began = time.monotonic()
    with pytest.raises(kafka_errors.TopicAuthorizationFailedError):
        scanner.offset_range("t", 0)
    assert time.monotonic() - began < 1.0
    assert len(admin.asked) == 1


def test_a_retriable_answer_is_raised_once_the_lookup_time_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scanner_module, "OFFSET_LOOKUP_SECONDS", 0.5)
    admin = ScriptedAdmin([kafka_errors.LeaderNotAvailableError() for _ in range(1000)])
    scanner = scanner_with(admin, monkeypatch)

    began = time.monotonic()
    with pytest.raises(kafka_errors.LeaderNotAvailableError):
        scanner.offset_range("t", 0)
    took = time.monotonic() - began
    assert 0.3 <= took < 1.5, took
    # It paused between tries: a handful of questions, not a busy loop.
    assert 2 <= len(admin.asked) <= 10, len(admin.asked)


def test_a_partition_without_a_leader_is_named_and_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With every in-sync replica down, the metadata names leader -1, and the
    # admin client fails to find broker -1 (seen on a three-broker cluster
    # with a one-replica topic whose broker was killed).
    admin = ScriptedAdmin([kafka_errors.UnknownBrokerIdError(-1), 0, 9])
    scanner = scanner_with(admin, monkeypatch)

    with pytest.raises(kafka_errors.LeaderNotAvailableError, match=r"t\[3\] has no leader"):
        scanner.offset_range("t", 3)
    assert len(admin.asked) == 1


def test_a_leader_on_a_broker_the_client_does_not_know_gets_a_new_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The admin client looks the leader up afresh, but connects through a list
    # of brokers refreshed only every five minutes: a broker that was down at
    # the last refresh and now leads is unknown to it.
    admin = ScriptedAdmin([kafka_errors.UnknownBrokerIdError(7), 4, 9])
    scanner = scanner_with(admin, monkeypatch)

    assert scanner.offset_range("t", 0) == (4, 9)
    assert (admin.built, admin.closed) == (2, 1)


def test_an_admin_client_that_cannot_bootstrap_leaves_no_thread() -> None:
    # kafka-python's own client starts its IO thread before it bootstraps and
    # leaves it running when that fails: one thread per pass of an outage.
    def io_threads() -> int:
        return sum(t.name.startswith("kafka-io") for t in threading.enumerate())

    before = io_threads()
    for _ in range(3):
        with pytest.raises(kafka_errors.KafkaError):
            scanner_module._AdminClient(
                bootstrap_servers="127.0.0.1:9",  # nothing listens there
                bootstrap_timeout_ms=300,
                request_timeout_ms=300,
            )
    wait_until(lambda: io_threads() == before, timeout=5, what="the IO threads to end")
