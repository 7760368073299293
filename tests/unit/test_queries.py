"""The named SQL statements file and its parser (outbox/queries.py, outbox/queries.sql)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

import outbox
import publisher
from outbox.queries import parse_queries, query

#: Names the library and the publisher look up with query("..."), found by grepping the code.
USED_NAMES = [
    "insert_messages",
    "ids_by_idempotency_key",
    "claim_batch",
    "lock_batch",
    "mark_sending",
    "settle_batch",
    "settle_delivered",
    "recover_expired_leases",
    "decision_check",
    "resolve_lock",
    "uncertain_due",
    "decide_uncertain",
    "resolve_message",
    "work_left",
    "seconds_until_due",
    "pin_read_committed",
    "register_publisher",
    "heartbeat",
    "stop_publisher",
    "status",
]


def _shipped() -> dict[str, str]:
    text = resources.files("outbox").joinpath("queries.sql").read_text(encoding="utf-8")
    return parse_queries(text)


def test_parse_queries_splits_named_blocks_and_drops_comment_lines() -> None:
    """Each "-- name:" block becomes one entry whose SQL has no comment lines and no padding."""
    text = (
        "-- A file header that belongs to no query.\n"
        "\n"
        "-- name: first\n"
        "-- What the first query does.\n"
        "SELECT 1\n"
        "  -- an indented comment\n"
        "FROM t\n"
        "\n"
        "-- name: second\n"
        "UPDATE t SET x = 1 -- a trailing comment stays with its SQL\n"
        "WHERE id = %(id)s\n"
    )
    assert parse_queries(text) == {
        "first": "SELECT 1\nFROM t",
        "second": "UPDATE t SET x = 1 -- a trailing comment stays with its SQL\nWHERE id = %(id)s",
    }


def test_parse_queries_of_text_without_names_is_empty() -> None:
    """Text with no "-- name:" line defines no query."""
    assert parse_queries("-- just a comment\nSELECT 1\n") == {}


def test_parse_queries_rejects_a_name_defined_twice() -> None:
    """A query name used for two blocks raises ValueError naming it."""
    text = "-- name: same\nSELECT 1\n-- name: other\nSELECT 2\n-- name: same\nSELECT 3\n"
    with pytest.raises(ValueError, match="query 'same' is defined twice"):
        parse_queries(text)


def test_shipped_queries_parse_into_non_empty_sql_without_comments() -> None:
    """Every statement in the shipped queries.sql has SQL and no comment-only line."""
    queries = _shipped()
    assert queries
    for name, sql in queries.items():
        assert sql, name
        assert not any(line.lstrip().startswith("--") for line in sql.splitlines()), name


@pytest.mark.parametrize("name", USED_NAMES)
def test_shipped_queries_define_every_name_the_code_uses(name: str) -> None:
    """Each query name the code looks up is defined, and query() returns its SQL."""
    assert name in _shipped()
    assert query(name) == _shipped()[name]


def test_every_query_call_in_the_code_names_a_shipped_query() -> None:
    """Every literal query("...") (or the store's _sql("...")) names a statement of queries.sql."""
    call = re.compile(r"""\b(?:query|_sql)\(\s*["'](\w+)["']\s*\)""")
    used: set[str] = set()
    for package in (outbox, publisher):
        for source in Path(str(package.__file__)).parent.glob("*.py"):
            used.update(call.findall(source.read_text(encoding="utf-8")))
    assert set(USED_NAMES) <= used
    assert used <= set(_shipped())


def test_query_of_an_unknown_name_raises_key_error_naming_it() -> None:
    """query() of a name the file does not define raises KeyError that names it."""
    with pytest.raises(KeyError, match="'nope'"):
        query("nope")
