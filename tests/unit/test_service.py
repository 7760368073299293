"""The base of the background threads (publisher/service.py), with a service that records turns.

Nothing here sleeps: each test waits on an event the service sets, with a
timeout that only a failure reaches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest

from publisher.service import BackgroundService

#: Longer than any test: a turn that waits this long never comes.
NEVER = 3_600.0


class Recorder(BackgroundService):
    """Counts its turns, sets ``turned`` after each, and runs ``work`` in each."""

    recoverable = (ConnectionError,)

    def __init__(self, *, interval: float = NEVER, run_at_start: bool = False) -> None:
        super().__init__(name="test-service", interval=interval, run_at_start=run_at_start)
        self.turns = 0
        self.turned = threading.Event()
        self.failures: list[Exception] = []
        self.work: Callable[[int], None] = lambda _turn: None

    def run_once(self) -> None:
        self.turns += 1
        self.work(self.turns)
        self.turned.set()

    def _failed(self, exc: Exception) -> None:
        self.failures.append(exc)


@pytest.fixture
def service() -> Iterator[Recorder]:
    """A recorder, stopped after the test whatever happened."""
    recorder = Recorder()
    yield recorder
    recorder.stop(timeout=5)


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_run_once_is_one_turn_in_the_callers_thread(service: Recorder) -> None:
    """run_once does the work without a thread being started."""
    service.run_once()
    assert service.turns == 1
    assert not service.running


def test_start_twice_runs_one_thread_under_the_services_name(service: Recorder) -> None:
    """A second start() leaves the one running thread alone."""
    service.start()
    service.start()
    assert len(_threads("test-service")) == 1
    assert service.running


def test_stop_wakes_a_waiting_thread_at_once(service: Recorder) -> None:
    """With an hour to the next turn, stop() ends the thread within its timeout."""
    service.start()
    [thread] = _threads("test-service")
    service.stop(timeout=5)
    assert not thread.is_alive()
    assert service.turns == 0


def test_stop_twice_or_before_start_is_harmless_and_final(service: Recorder) -> None:
    """stop() before start() and again after raises nothing, and start() then runs nothing."""
    service.stop()
    service.start()
    service.stop()
    assert not service.running
    assert _threads("test-service") == []


def test_the_first_turn_comes_at_once_with_run_at_start() -> None:
    """run_at_start turns before the first wait, however long the interval."""
    service = Recorder(run_at_start=True)
    service.start()
    try:
        assert service.turned.wait(timeout=5)
    finally:
        service.stop(timeout=5)
    assert service.turns == 1


def test_a_recoverable_error_does_not_end_the_thread() -> None:
    """A turn that raises a recoverable error goes to _failed, and the next turn comes."""
    service = Recorder(interval=0.0)

    def fail_once(turn: int) -> None:
        if turn == 1:
            raise ConnectionError("database went away")

    service.work = fail_once
    service.start()
    try:
        assert service.turned.wait(timeout=5)
    finally:
        service.stop(timeout=5)
    assert [str(e) for e in service.failures] == ["database went away"]
    assert service.turns >= 2


def test_any_other_error_ends_the_thread_through_the_excepthook(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error that is not recoverable is a bug: the thread ends, the log and the
    excepthook report it, and ``died`` keeps it (readiness fails on it)."""
    reported: list[type[BaseException] | None] = []
    done = threading.Event()

    def hook(args: threading.ExceptHookArgs) -> None:
        reported.append(args.exc_type)
        done.set()

    monkeypatch.setattr(threading, "excepthook", hook)
    service = Recorder(run_at_start=True)

    def bug(_turn: int) -> None:
        raise KeyError("bug")

    service.work = bug
    service.start()
    try:
        assert done.wait(timeout=5)
    finally:
        service.stop(timeout=5)
    assert reported == [KeyError]
    assert service.failures == []
    assert not service.running
    assert isinstance(service.died, KeyError)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == f"{service.name} ended by an unexpected error"
    assert record.exc_info is not None


def test_stop_waits_for_a_turn_in_progress_only_up_to_its_timeout() -> None:
    """A turn that outlives stop()'s timeout keeps the thread running; it ends with the turn."""
    service = Recorder(run_at_start=True)
    entered, release = threading.Event(), threading.Event()

    def block(_turn: int) -> None:
        entered.set()
        release.wait(timeout=30)

    service.work = block
    service.start()
    assert entered.wait(timeout=5)
    service.stop(timeout=0.01)
    assert service.running
    assert service.stopping
    release.set()
    service.stop(timeout=5)
    assert not service.running


class Failing(BackgroundService):
    """Fails its turns with the same recoverable error until told to succeed."""

    recoverable = (ConnectionError,)

    def __init__(self) -> None:
        super().__init__(name="test-failing", interval=NEVER)
        self.fail = True

    def run_once(self) -> None:
        if self.fail:
            raise ConnectionError("the database went away")


def test_a_turn_failing_again_and_again_is_logged_once_and_its_end_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A service turning every second through an outage logs it once, not every turn, and
    says when a turn succeeds again."""
    service = Failing()
    caplog.set_level(logging.INFO, logger="publisher.service")
    for _ in range(20):
        service._turn()
    service.fail = False
    service._turn()
    service._turn()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "test-failing failed (the database went away); retrying"),
        ("INFO", "test-failing failed: over after 0s (20 failed tries)"),
    ]
