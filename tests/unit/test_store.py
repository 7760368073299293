"""The store's pure helpers (no database)."""

from __future__ import annotations

import uuid

import pytest

from publisher.store import array_literal, claim_statement


def test_array_literal_writes_each_kind_and_refuses_the_rest() -> None:
    """NULL, booleans, numbers, ids and quoted text; bytes are an error, not their repr."""
    i = uuid.UUID(int=1)
    assert array_literal([None, True, False, 7, 0.5, i, 'a"b\\c']) == (
        f'{{NULL,t,f,7,0.5,{i},"a\\"b\\\\c"}}'
    )
    with pytest.raises(TypeError, match="not b'x'"):
        array_literal([b"x"])


def test_only_a_claim_ahead_has_a_horizon() -> None:
    """The ordinary claim has no bound on its candidates; the claim-ahead does."""
    assert "horizon" not in claim_statement(limit=500)
    ahead = claim_statement(limit=500, horizon=1000)
    assert "horizon AS MATERIALIZED" in ahead
    assert ahead.count("(SELECT seq FROM horizon)") == 32


def test_the_claims_limits_are_written_into_it() -> None:
    """Integers in the text (so that a prepared claim's generic plan knows them), not parameters."""
    sql = claim_statement(limit=500, horizon=1000)
    assert "%(limit)s" not in sql
    assert "%(horizon)s" not in sql
    assert sql.count("LIMIT 500") == 33  # a branch per lane, and the claim
    assert sql.count("LIMIT 1000") == 1  # the horizon
    assert sql.count("LIMIT 1500") == 32  # its branch per lane: the horizon and one batch
    with pytest.raises(ValueError, match="at least 1"):
        claim_statement(limit=0)
    with pytest.raises(ValueError, match="at least 1"):
        claim_statement(limit=5, horizon=0)
