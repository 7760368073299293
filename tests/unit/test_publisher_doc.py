"""docs/publisher.md documents every setting and every metric the publisher has."""

from __future__ import annotations

from pathlib import Path

import pytest

from publisher.config import SETTINGS, Setting
from publisher.health import Health
from publisher.metrics import PublisherMetrics
from tests.unit.test_metrics import LINES, FakeReader

DOC = (Path(__file__).resolve().parents[2] / "docs" / "publisher.md").read_text()


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_setting_is_in_the_table(setting: Setting) -> None:
    """Its flag, environment variable and file key all appear in the settings table."""
    # A secret has no flag (its value would show in ps): its row says so.
    start = f"| `{setting.flag}`" if setting.has_flag else f"| (no flag) | `{setting.env}`"
    row = next((line for line in DOC.splitlines() if line.startswith(start)), None)
    assert row is not None, f"{setting.flag if setting.has_flag else setting.env} has no row"
    assert setting.env in row
    assert f"`{setting.key}" in row


def test_every_metric_is_in_the_list() -> None:
    """Each metric family the publisher exports (process_* aside) has a row with its name."""
    metrics = PublisherMetrics(Health(stall_seconds=50, alive_seconds=110))
    metrics.watch_status(FakeReader(LINES))
    names = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.registry.collect()
        if not family.name.startswith("process_")
    }
    assert "outbox_messages" in names
    missing = [name for name in sorted(names) if f"| `{name}` |" not in DOC]
    assert not missing, missing
