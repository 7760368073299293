"""Named SQL statements, loaded once from ``queries.sql`` beside this module.

Keeping SQL in one file lets a reader (or a DBA) review every statement the
library and the publisher send without reading Python.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split a queries file into ``{name: sql}``; comment lines are kept out."""
    parts = _NAME_RE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        sql = "\n".join(lines).strip()
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = sql
    return queries


@cache
def _all() -> dict[str, str]:
    text = resources.files("outbox").joinpath("queries.sql").read_text(encoding="utf-8")
    return parse_queries(text)


def query(name: str) -> str:
    """Return the SQL of the named query; ``KeyError`` names an unknown one."""
    try:
        return _all()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in outbox/queries.sql") from None
