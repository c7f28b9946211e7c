"""The import rule (docs/architecture.md) as a test: imports point one way.

Every ``.py`` file of ``fedps/``, ``crypto/``, ``clients/`` and ``server/`` is parsed and each
of its imports (at module level or inside a function, absolute or relative) checked:

- ``crypto/`` imports nothing of ours but ``fedps.errors`` (and ``crypto/`` itself);
- ``clients/`` never imports ``server/``, and ``server/`` never imports ``clients/``;
- outside the CLI face (``fedps/cli/``), ``fedps/`` and ``crypto/`` import neither.

Tests are not checked: they may start any role.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("fedps", "crypto", "clients", "server")
_CLI = "fedps.cli"
_CRYPTO_MAY_IMPORT = ("crypto", "fedps.errors")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every module that ``path``, module ``name``, imports
    (``from a import b`` yields ``a.b``: ``b`` may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _broken_rule(importer: str, imported: str) -> str | None:
    """Which rule ``importer`` importing ``imported`` breaks, if any."""
    top = imported.split(".")[0]
    if top not in _PACKAGES:
        return None  # the standard library or a dependency
    home = importer.split(".")[0]
    if home == "crypto" and not any(_within(imported, ok) for ok in _CRYPTO_MAY_IMPORT):
        return "crypto/ imports nothing of ours but fedps.errors"
    if {home, top} == {"clients", "server"}:
        return "clients/ and server/ never import each other"
    roles = ("clients", "server")
    if top in roles and home not in roles and not _within(importer, _CLI):
        return "only the CLI face (fedps/cli/) imports clients/ or server/"
    return None


def _violations() -> Iterator[str]:
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            importer = _module_name(path)
            for line, imported in _imports(path, importer):
                rule = _broken_rule(importer, imported)
                if rule is not None:
                    where = path.relative_to(_ROOT).as_posix()
                    yield f"{where}:{line}: imports {imported}: {rule}"


def test_imports_point_one_way() -> None:
    # Execute
    violations = list(_violations())

    # Assert
    assert not violations, "the import rule is broken:\n" + "\n".join(violations)


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("crypto.tls", "fedps.config", "crypto/"),
        ("crypto.tls", "fedps.errors", None),
        ("crypto.tls", "crypto.files", None),
        ("clients.edge_client", "server.shard.shard", "each other"),
        ("server.serve", "clients.edge_client", "each other"),
        ("fedps.transport", "server.serve", "CLI face"),
        ("crypto.params", "clients", "crypto/"),
        ("fedps.cli.app", "server.serve", None),
        ("fedps.cli.demo", "clients.edge_client", None),
        ("server.serve", "fedps.config", None),
        ("fedps.transport", "grpc", None),
    ],
)
def test_the_rule_names_what_it_refuses(importer: str, imported: str, rule: str | None) -> None:
    # Execute
    broken = _broken_rule(importer, imported)

    # Assert
    assert broken is None if rule is None else rule in (broken or "")


def test_relative_and_function_level_imports_are_seen(tmp_path: Path) -> None:
    # Prepare: a module written as crypto/x.py would be, importing in a function
    source = "def f() -> None:\n    from fedps import config\n    from . import tls\n"
    path = tmp_path / "probe.py"
    path.write_text(source)

    # Execute
    found = list(_imports(path, "crypto.probe"))

    # Assert
    assert found == [(2, "fedps.config"), (3, "crypto.tls")]
    assert _broken_rule("crypto.probe", found[0][1]) is not None
