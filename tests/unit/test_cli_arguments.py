"""The `outbox` command's refusals of bad arguments: each names the argument and what it
takes, in the operator's words (not a Python function or class name)."""

from __future__ import annotations

import pytest

from tests.support import run_outbox_cli

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
def test_a_bad_argument_is_named_with_what_it_takes(argv: list[str], said: str) -> None:
    """Refused before any connection (the database need not exist)."""
    refused = run_outbox_cli("postgresql://h/db", *argv)
    assert refused.returncode == 2
    err = refused.stderr
    assert said in err
    assert "_fence" not in err
    assert "State value" not in err


def test_an_argument_the_command_does_not_take_shows_that_commands_usage() -> None:
    """`outbox discard --force-before-deadline` (a flag of resolve's): the discard usage,
    not the top-level one; a value after it is not repeated (it may be a secret)."""
    refused = run_outbox_cli(
        "postgresql://h/db", "discard", MESSAGE_ID, "--reason", "r",
        "--force-before-deadline", "--kafka-sasl-password", "s3cret",
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.startswith("usage: outbox discard ")
    assert (
        "outbox discard: error: unrecognized arguments: --force-before-deadline "
        "--kafka-sasl-password ..."
    ) in refused.stderr
    assert "s3cret" not in refused.stderr
