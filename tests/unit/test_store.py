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
    assert "%(horizon)s" not in claim_statement(ahead=False)
    assert "%(horizon)s" in claim_statement(ahead=True)
