"""SQL lives in schema/*.sql and the named queries, not in Python strings."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A string that starts like a statement.
STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|SET|RESET|CREATE|ALTER|DROP|LOCK|LISTEN|UNLISTEN|"
    r"NOTIFY|DO|GRANT|REVOKE|BEGIN|COMMIT|ROLLBACK|TRUNCATE|VACUUM|ANALYZE)\s",
)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes: examples there are prose, not statements sent."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_no_module_of_the_library_or_the_publisher_holds_a_statement() -> None:
    """Every statement is in outbox/queries.sql, outbox/roles.sql or schema/, where a reader
    (or a DBA) reviews them all without reading Python."""
    offenders = []
    for path in sorted([*(ROOT / "outbox").glob("*.py"), *(ROOT / "publisher").glob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in prose
                and STATEMENT.match(node.value)
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert offenders == []
