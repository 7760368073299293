"""Every database connection of the publisher is opened by its connector."""

from __future__ import annotations

import re
from pathlib import Path

import publisher

PUBLISHER = Path(publisher.__file__).parent


def test_only_the_connector_opens_connections() -> None:
    """No module of the publisher but the connector calls psycopg's connect: each
    connection is pinned to READ COMMITTED in that one place."""
    opening = re.compile(
        r"\bpsycopg\s*\.\s*(Async)?Connection\s*\.\s*connect\b|\bpsycopg\s*\.\s*connect\b"
    )
    found = sorted(path.name for path in PUBLISHER.glob("*.py") if opening.search(path.read_text()))
    assert found == ["connector.py"]
