"""The import rules import-linter cannot see, read from the source with ``ast``.

The architecture rules are import-linter contracts in pyproject.toml
(``[tool.importlinter]``), checked by ``lint-imports`` in ``make test``: the
library imports neither the publisher nor a Kafka or metrics client, nothing
imports a command-line module, and outcome classification and partitioning
do no I/O. import-linter reads packages only (``outbox``, ``publisher``,
``tests``); ``benchmarks/`` and ``examples/`` are folders of scripts, so the
CLI rule is checked here for them, against the protected modules the contract
names. Every import counts: at the top of a module or inside a function,
absolute or relative.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The folders of scripts that are no package, hence not seen by import-linter.
SCRIPT_FOLDERS = ("benchmarks", "examples")


#: import-linter's configuration, ``[tool.importlinter]`` of pyproject.toml.
IMPORTLINTER: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "importlinter"
]


def _contract(contract_id: str) -> dict[str, Any]:
    contracts: list[dict[str, Any]] = IMPORTLINTER["contracts"]
    [contract] = [c for c in contracts if c.get("id") == contract_id]
    return contract


#: The command-line modules, as the no-cli-imports contract protects them.
CLI_MODULES: tuple[str, ...] = tuple(_contract("no-cli-imports")["protected_modules"])


def _modules(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, dotted, including ``pkg.name`` of ``from pkg import name``.

    Relative imports are resolved from the module's place under ``root``.
    """
    package = list(path.relative_to(root).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            # ``from publisher import cli`` imports the module publisher.cli.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _is_within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_script_imports_a_cli() -> None:
    """No benchmark or example imports a CLI module; they build publishers with publisher.app."""
    offenders = {
        _name(path): sorted(m for m in imported_modules(path) if _is_within(m, CLI_MODULES))
        for path in _modules(*SCRIPT_FOLDERS)
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert offenders == {}, (
        f"these scripts import a CLI module; build a publisher with publisher.app instead: "
        f"{offenders}"
    )


def test_every_command_module_is_protected() -> None:
    """Every module of outbox/ and publisher/ named cli or *_cli is a protected module."""
    found = {
        f"{path.parent.name}.{path.stem}"
        for path in _modules("outbox", "publisher")
        if path.stem == "cli" or path.stem.endswith("_cli")
    }
    assert found == set(CLI_MODULES)


def test_the_script_folders_are_not_packages() -> None:
    """The folders checked here are no packages (a package belongs in root_packages instead)."""
    packages = [f for f in SCRIPT_FOLDERS if (ROOT / f / "__init__.py").exists()]
    assert packages == []
    assert set(IMPORTLINTER["root_packages"]).isdisjoint(SCRIPT_FOLDERS)


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("import publisher.cli", "tests/t.py", "publisher.cli"),
        ("from publisher.cli import main", "tests/t.py", "publisher.cli"),
        ("from publisher import cli", "tests/t.py", "publisher.cli"),
        ("from . import cli", "publisher/x.py", "publisher.cli"),
        ("from .cli import main", "publisher/x.py", "publisher.cli"),
        ("def f():\n    from outbox.cli import main", "benchmarks/b.py", "outbox.cli"),
    ],
)
def test_every_form_of_import_is_seen(
    source: str, where: str, expected: str, tmp_path: Path
) -> None:
    """Absolute, from-package, relative and function-level imports all name the module."""
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(source + "\n")
    assert expected in imported_modules(path, tmp_path)


def test_the_alembic_example_loads_without_a_kafka_client() -> None:
    """examples/migrations is the Alembic project a service copies, and its env.py takes the
    models from demo_service: neither may import Kafka or the publisher when loaded (a
    service that only enqueues installs neither), only inside the demo's read-back."""
    loaded = {
        _name(path): sorted(
            module
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Import | ast.ImportFrom)
            for module in (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            if _is_within(module, ("kafka", "confluent_kafka", "publisher"))
        )
        for path in (ROOT / "examples/migrations/env.py", ROOT / "examples/demo_service.py")
    }
    assert loaded == {"examples/migrations/env.py": [], "examples/demo_service.py": []}
