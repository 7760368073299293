"""What a library-only install says when an extra's module is imported (no database)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_outbox_metadata_without_sqlalchemy_names_the_extra() -> None:
    """``outbox.metadata`` needs the sqlalchemy extra; without it the error says which."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["sqlalchemy"] = None  # as if it were not installed
        import outbox  # the library itself needs no SQLAlchemy
        try:
            import outbox.metadata
        except ModuleNotFoundError as missing:
            print(missing.name, "|", missing)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "sqlalchemy | outbox.metadata describes the outbox tables to SQLAlchemy, which is not "
        "installed: pip install 'pg-kafka-outbox[sqlalchemy]'"
    )
