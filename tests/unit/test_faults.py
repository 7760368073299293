"""The crash and pause switches (publisher/faults.py) and the gate they need."""

from __future__ import annotations

import logging

import pytest

from publisher.faults import Faults, FaultSpecError


def test_switches_without_the_gate_are_ignored_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Set without OUTBOX_ENABLE_FAULTS=1, both switches are ignored and one warning names them."""
    environ = {"OUTBOX_CRASH_AT": "after_claim:2", "OUTBOX_PAUSE_AT": "after_send"}
    with caplog.at_level(logging.WARNING, logger="publisher.faults"):
        faults = Faults.from_env(environ)
    assert (faults.crash, faults.pause) == (None, None)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "OUTBOX_CRASH_AT and OUTBOX_PAUSE_AT set but ignored" in message
    assert "OUTBOX_ENABLE_FAULTS=1" in message
    assert "after_claim" not in message  # the names, not the values


@pytest.mark.parametrize("gate", ["", "0", "true", "yes", " 1"])
def test_only_exactly_1_opens_the_gate(gate: str, caplog: pytest.LogCaptureFixture) -> None:
    """Any other value of OUTBOX_ENABLE_FAULTS keeps the switches off."""
    with caplog.at_level(logging.WARNING, logger="publisher.faults"):
        faults = Faults.from_env({"OUTBOX_ENABLE_FAULTS": gate, "OUTBOX_CRASH_AT": "after_ack"})
    assert faults.crash is None
    assert [r.getMessage().split(" set but")[0] for r in caplog.records] == ["OUTBOX_CRASH_AT"]


def test_a_bad_value_without_the_gate_is_not_even_read(caplog: pytest.LogCaptureFixture) -> None:
    """An ignored switch cannot stop a publisher from starting, whatever its value."""
    with caplog.at_level(logging.WARNING, logger="publisher.faults"):
        faults = Faults.from_env({"OUTBOX_PAUSE_AT": "nowhere:0"})
    assert faults.pause is None
    assert len(caplog.records) == 1


def test_no_switch_no_gate_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A production environment (nothing set, or empty values) logs nothing."""
    with caplog.at_level(logging.DEBUG, logger="publisher.faults"):
        faults = Faults.from_env({"OUTBOX_CRASH_AT": "", "PATH": "/usr/bin"})
    assert (faults.crash, faults.pause) == (None, None)
    assert caplog.records == []


def test_with_the_gate_the_switches_are_read(caplog: pytest.LogCaptureFixture) -> None:
    """OUTBOX_ENABLE_FAULTS=1 makes both switches take effect, silently."""
    environ = {
        "OUTBOX_ENABLE_FAULTS": "1",
        "OUTBOX_CRASH_AT": "after_claim:2",
        "OUTBOX_PAUSE_AT": "after_send",
    }
    with caplog.at_level(logging.WARNING, logger="publisher.faults"):
        faults = Faults.from_env(environ)
    assert (faults.crash, faults.pause) == (("after_claim", 2), ("after_send", 1))
    assert caplog.records == []


def test_with_the_gate_a_bad_value_is_refused() -> None:
    """An enabled switch that names no cut is a FaultSpecError naming the variable."""
    with pytest.raises(FaultSpecError, match="OUTBOX_CRASH_AT='after_lunch'"):
        Faults.from_env({"OUTBOX_ENABLE_FAULTS": "1", "OUTBOX_CRASH_AT": "after_lunch"})
