"""The store's pure helpers (no database)."""

from __future__ import annotations

import uuid

import pytest

from outbox.states import WAITING_NOTE
from publisher.store import PublisherStore, array_literal, claim_statement


def test_array_literal_writes_each_kind_and_refuses_the_rest() -> None:
    """NULL, booleans, numbers, ids and quoted text; bytes are an error, not their repr."""
    i = uuid.UUID(int=1)
    assert array_literal([None, True, False, 7, 0.5, i, 'a"b\\c']) == (
        f'{{NULL,t,f,7,0.5,{i},"a\\"b\\\\c"}}'
    )
    with pytest.raises(TypeError, match="not b'x'"):
        array_literal([b"x"])


OWNER = uuid.UUID("0b6e2a52-3f5e-4c1f-9d6e-2b3c4d5e6f70")


def _claim(limit: int, horizon: int | None = None, lease_seconds: float = 30.0) -> str:
    return claim_statement(owner=OWNER, lease_seconds=lease_seconds, limit=limit, horizon=horizon)


def test_only_a_claim_ahead_has_a_horizon() -> None:
    """The ordinary claim has no bound on its candidates; the claim-ahead does."""
    assert "horizon" not in _claim(500)
    ahead = _claim(500, horizon=1000)
    assert "horizon AS MATERIALIZED" in ahead
    assert ahead.count("(SELECT seq FROM horizon)") == 32


def test_the_claim_takes_no_parameters() -> None:
    """Its values are written into its text: PostgreSQL plans it once per connection."""
    sql = _claim(500, horizon=1000, lease_seconds=12.5)
    assert "%(" not in sql
    assert sql.count("LIMIT 500") == 33  # a branch per lane, and the claim
    assert sql.count("LIMIT 1000") == 1  # the horizon
    assert sql.count("LIMIT 1500") == 32  # its branch per lane: the horizon and one batch
    assert sql.count(f"'{OWNER}'::uuid") == 2  # the lanes it owns, the batch's owner
    assert "make_interval(secs => 12.5::float8)" in sql


@pytest.mark.parametrize(
    ("limit", "horizon", "lease_seconds", "problem"),
    [
        (0, None, 30.0, "limits of at least 1, got 0"),
        (5, 0, 30.0, "limits of at least 1, got 5 and 0"),
        (5, None, 0.0, "lease of more than 0 seconds, got 0.0"),
        (5, None, float("nan"), "lease of more than 0 seconds, got nan"),
        (5, None, float("inf"), "lease of more than 0 seconds, got inf"),
    ],
)
def test_a_claim_with_a_value_it_cannot_take_is_refused(
    limit: int, horizon: int | None, lease_seconds: float, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        _claim(limit, horizon=horizon, lease_seconds=lease_seconds)


def test_a_waiting_note_without_its_prefix_is_refused_before_any_sql() -> None:
    """The prefix is how the note is told apart from an attempt's error when it gives way."""
    store = PublisherStore("postgresql://127.0.0.1:1/nowhere", uuid.uuid4())
    with pytest.raises(ValueError, match="a waiting note starts 'reconciliation waits: '"):
        store.note_waiting([], "the session could not be fenced")
    assert store.note_waiting([], f"{WAITING_NOTE}a test") == 0  # nothing to write, no SQL
