"""The `outbox` command's refusals of bad arguments: each names the argument and what it
takes, in the operator's words (not a Python function or class name)."""

from __future__ import annotations

import pytest

from outbox.cli import main

MESSAGE_ID = "01a23e2b-3c84-7466-aa4a-3a6151621c0c"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["resolve", MESSAGE_ID, "--pending", "--fence", "abc", "--reason", "r"],
            "argument --fence: a fence is a whole number (as `outbox inspect ID` shows it), "
            "got 'abc'",
        ),
        (
            ["resolve", MESSAGE_ID, "--pending", "--fence", "-1", "--reason", "r"],
            "argument --fence: a fence is never negative, got -1",
        ),
        (
            ["list", "--state", "held"],
            "argument --state: 'held' is not a state; one of: pending, in_flight, delivered, "
            "uncertain, quarantined, discarded",
        ),
    ],
    ids=["fence-not-a-number", "fence-negative", "state-unknown"],
)
def test_a_bad_argument_is_named_with_what_it_takes(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--database-url", "postgresql://h/db", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "_fence" not in err
    assert "State value" not in err
