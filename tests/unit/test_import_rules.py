"""Import rules the layout depends on, read from the source with ``ast`` (nothing is imported).

* Nothing imports a CLI module (``outbox.cli``, ``publisher.cli``): code
  that needs a publisher builds it through the composition root,
  ``publisher.app``, as the command does. A CLI runs as a process (the
  console scripts in pyproject.toml, ``python -m outbox.cli`` in the tests),
  which is not an import and is always allowed. The exceptions, each with
  its reason, are ``CLI_IMPORTS_ALLOWED``: the ``python -m publisher`` entry
  point, and the CLI's own tests of its flag parsing.
* The library (``outbox/``) imports neither the publisher nor a Kafka
  client, so a service that embeds it pulls in neither. The ``outbox``
  operator command is the one exception (``outbox reconcile`` reads Kafka
  through the publisher's reconciler); the rule above keeps it a leaf that
  no library module imports.

Every import counts: at the top of a module or inside a function, absolute
or relative.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The folders whose modules the rules cover.
CHECKED = ("outbox", "publisher", "tests", "benchmarks", "examples")

CLI_MODULES = ("outbox.cli", "publisher.cli")

#: File -> why it may import a CLI module.
CLI_IMPORTS_ALLOWED = {
    "publisher/__main__.py": "``python -m publisher`` is an entry point, like the console script",
    "tests/unit/test_config.py": (
        "the CLI's own test: flags, environment and config file reach the config "
        "through its parser (config_from_args)"
    ),
}

#: What the library must not import: the publisher and the Kafka clients.
NOT_FOR_THE_LIBRARY = ("publisher", "kafka", "confluent_kafka")

#: Library files that may import them anyway, and why.
LIBRARY_EXCEPTIONS = {
    "outbox/cli.py": (
        "the operator command: ``outbox reconcile`` builds the publisher's reconciler and "
        "reads Kafka; no library module imports it (the CLI rule checks that)"
    ),
}


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


def test_no_module_imports_a_cli() -> None:
    """Outside the listed exceptions, no module imports ``outbox.cli`` or ``publisher.cli``."""
    offenders = {
        _name(path): sorted(m for m in imported_modules(path) if _is_within(m, CLI_MODULES))
        for path in _modules(*CHECKED)
        if _name(path) not in CLI_IMPORTS_ALLOWED
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert offenders == {}, (
        f"these modules import a CLI module; build a publisher with publisher.app instead: "
        f"{offenders}"
    )


def test_every_cli_import_exception_is_still_needed() -> None:
    """Each file allowed to import a CLI module exists and does import one."""
    unneeded = [
        name
        for name in CLI_IMPORTS_ALLOWED
        if not (ROOT / name).exists()
        or not any(_is_within(m, CLI_MODULES) for m in imported_modules(ROOT / name))
    ]
    assert unneeded == []


def test_the_library_imports_neither_the_publisher_nor_a_kafka_client() -> None:
    """No module of ``outbox/`` but the operator command imports publisher, kafka or confluent."""
    offenders = {
        _name(path): sorted(m for m in imported_modules(path) if _is_within(m, NOT_FOR_THE_LIBRARY))
        for path in _modules("outbox")
        if _name(path) not in LIBRARY_EXCEPTIONS
    }
    offenders = {name: found for name, found in offenders.items() if found}
    assert offenders == {}, f"the library must not import these: {offenders}"


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
