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
        (
            ["list", "--state", "pending", "--limit", "abc"],
            "argument --limit: 'abc' is not a whole number",
        ),
        (
            ["list", "--state", "pending", "--limit", "99999999999999999999"],
            "argument --limit: must be from 1 to 2,147,483,647, got 99,999,999,999,999,999,999",
        ),
        (
            ["resolve", MESSAGE_ID, "--pending", "--fence", str(2**63), "--reason", "r"],
            "argument --fence: a fence is at most 9,223,372,036,854,775,807",
        ),
        (
            ["migrate", "--lock-timeout", "1e20"],
            "argument --lock-timeout: must be more than 0 seconds and at most 2,147,483, got 1e20",
        ),
    ],
    ids=[
        "fence-not-a-number",
        "fence-negative",
        "state-unknown",
        "limit-not-a-number",
        "limit-past-int32",
        "fence-past-bigint",
        "lock-timeout-past-int32-ms",
    ],
)
def test_a_bad_argument_is_named_with_what_it_takes(argv: list[str], said: str) -> None:
    """Refused before any connection (the database need not exist)."""
    refused = run_outbox_cli("postgresql://h/db", *argv)
    assert refused.returncode == 2
    err = refused.stderr
    assert said in err
    assert "_fence" not in err
    assert "_positive_int" not in err
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


#: A database nothing answers at: these refusals come before any connection.
NOWHERE = "postgresql://nobody@127.0.0.1:1/nowhere"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["purge", "--delivered-older-than", "1m"],
            "the delivered window (1 minute) is shorter than the minimum, 5 minutes",
        ),
        (
            ["purge", "--delivered-older-than", "7d", "--evidence-older-than", "1d"],
            "the evidence window (1 day) must be at least the delivered window (7 days)",
        ),
        (
            ["resolve", MESSAGE_ID, "--pending", "--reason", "r"],
            f"--pending needs --fence N, the fence `outbox inspect {MESSAGE_ID}` shows",
        ),
        (
            [
                "resolve",
                MESSAGE_ID,
                "--delivered",
                "--fence",
                "1",
                "--offset",
                "3",
                "--reason",
                "r",
            ],
            "--partition and --offset go together",
        ),
        (
            ["purge", "--delivered-older-than", "7d", "--evidence-older-than", "0.0000001s"],
            "evidence_older_than must be longer than zero",
        ),
        (["retry", "--quarantined", "--fence", "2"], "--fence goes with one message ID"),
        (["retry", MESSAGE_ID, "--topic", "t"], "--topic only goes with --quarantined"),
        (
            ["migrate", "--create-roles", "--writer-role", "x", "--publisher-role", "x"],
            "the writer, publisher and operator roles must differ",
        ),
        (["migrate", "--create-roles", "--operator-role", ""], "a role name is empty"),
    ],
    ids=[
        "purge-too-short",
        "purge-evidence-first",
        "purge-evidence-zero",
        "resolve-no-fence",
        "resolve-half-location",
        "retry-all-with-fence",
        "retry-one-with-topic",
        "roles-the-same",
        "role-empty",
    ],
)
def test_arguments_that_cannot_go_together_are_a_usage_error_before_connecting(
    argv: list[str], said: str
) -> None:
    """What the arguments alone refuse is said with the command's usage, before the
    database is asked (it does not answer here), and before a migration runs."""
    refused = run_outbox_cli(NOWHERE, *argv)
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"usage: outbox {argv[0]} ")
    last = refused.stderr.splitlines()[-1]
    assert last.startswith(f"outbox {argv[0]}: error: ")
    assert said in last
    assert "connection" not in refused.stderr


def test_a_blank_database_url_is_no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_DATABASE_URL set to blanks is not a URL: the command says there is none,
    instead of trying libpq's default socket."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "  ")
    refused = run_outbox_cli("  ", "status")
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == (
        "outbox status: error: no database: pass --database-url or set OUTBOX_DATABASE_URL"
    )
