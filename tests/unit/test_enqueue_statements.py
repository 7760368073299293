"""How enqueue_many splits its intents into INSERT statements: by rows and by bytes."""

from __future__ import annotations

import pytest

import outbox
from outbox.enqueue import (
    LARGEST_LIMIT,
    MAX_BYTES_PER_STATEMENT,
    MAX_ROWS_PER_STATEMENT,
    _needs_savepoint,
    _statements,
)
from outbox.intent import Intent, build_intent

MIB = 1024 * 1024


def _intents(count: int, value_bytes: int, **settings: int) -> list[Intent]:
    limits = {"max_value_bytes": max(value_bytes, 1), **settings}
    return [
        build_intent("orders", b"v" * value_bytes, key=None, headers=None, **limits)
        for _ in range(count)
    ]


def test_small_intents_go_5000_to_a_statement() -> None:
    intents = _intents(2 * MAX_ROWS_PER_STATEMENT + 1, 10)
    statements = _statements(intents)
    assert [len(s) for s in statements] == [MAX_ROWS_PER_STATEMENT, MAX_ROWS_PER_STATEMENT, 1]
    assert [i for s in statements for i in s] == intents


def test_large_intents_go_to_a_new_statement_past_64_mib() -> None:
    """Statements of at most 64 MiB of intents, in order; none is empty."""
    intents = _intents(70, MIB)
    statements = _statements(intents)
    assert [len(s) for s in statements] == [63, 7]  # 63 values and their topics fit in 64 MiB
    assert [i for s in statements for i in s] == intents
    assert _needs_savepoint(statements)


def test_an_intent_larger_than_the_budget_has_a_statement_of_its_own() -> None:
    huge = _intents(1, MAX_BYTES_PER_STATEMENT + 1, max_value_bytes=LARGEST_LIMIT)
    small = _intents(2, 10)
    statements = _statements([small[0], *huge, small[1]])
    assert [len(s) for s in statements] == [1, 1, 1]


def test_one_statement_needs_no_savepoint_unless_an_idempotency_key_may_need_a_second() -> None:
    assert not _needs_savepoint(_statements(_intents(3, 10)))
    keyed = [
        build_intent("orders", b"v", key=None, headers=None, idempotency_key=f"k{n}")
        for n in range(2)
    ]
    assert _needs_savepoint(_statements(keyed))
    assert not _needs_savepoint(_statements(keyed[:1]))


@pytest.mark.parametrize("name", ["max_value_bytes", "max_key_bytes", "max_header_bytes"])
def test_a_limit_past_100_mib_is_refused(name: str) -> None:
    """PostgreSQL takes no statement of 1 GB or more: one intent must fit in one."""
    assert getattr(outbox.Outbox(**{name: LARGEST_LIMIT}), name) == LARGEST_LIMIT
    with pytest.raises(ValueError, match=rf"Outbox {name} must be at most {LARGEST_LIMIT}"):
        outbox.Outbox(**{name: LARGEST_LIMIT + 1})
