"""The import rule (docs/architecture.md) as a test: imports point one way.

Every ``.py`` file of ``fedps/``, ``crypto/``, ``clients/`` and ``server/`` is parsed and each
of its imports (at module level or inside a function, absolute or relative) checked:

- ``crypto/`` imports nothing of ours but ``fedps.errors`` (and ``crypto/`` itself);
- ``clients/`` never imports ``server/``, and ``server/`` never imports ``clients/``;
- the composition layers stack: ``fedps/cli/`` (the commands) over ``fedps/experiments/``,
  ``fedps/bench/`` and ``fedps/dashboard/`` (side by side, none importing another), over
  ``fedps/runtime/`` (the API, local clusters, deployments), over everything else; nothing
  imports a layer above its own, and only the layers import ``clients/`` or ``server/``;
- in the shared core, ``fedps/rpc/`` (the wire), ``fedps/learning/`` (tasks, data, models,
  accounting), ``fedps/storage/`` and ``fedps/sharding/`` do not import each other, except
  that the wire may read block layouts (``fedps/sharding/``);
- ``fedps/__init__.py``, the API's front door, may name ``fedps/runtime/``, no command.

Tests are not checked: they may start any role.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("fedps", "crypto", "clients", "server")
_CRYPTO_MAY_IMPORT = ("crypto", "fedps.errors")
_ROLES = ("clients", "server")
#: The composition layers, each with its height: a module imports none of a greater height,
#: nor another of the same height (itself aside).
_LAYERS = {
    "fedps.cli": 3,
    "fedps.experiments": 2,
    "fedps.bench": 2,
    "fedps.dashboard": 2,
    "fedps.runtime": 1,
}
#: The core's parts, each with the parts it may import.
_CORE_PARTS = {
    "fedps.rpc": ("fedps.sharding",),
    "fedps.learning": (),
    "fedps.storage": (),
    "fedps.sharding": (),
}


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


def _layer(module: str) -> str | None:
    return next((layer for layer in _LAYERS if _within(module, layer)), None)


def _part(module: str) -> str | None:
    return next((part for part in _CORE_PARTS if _within(module, part)), None)


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
    importer_layer, imported_layer = _layer(importer), _layer(imported)
    if top in _ROLES and home not in _ROLES and importer_layer is None:
        return "only the composition layers (fedps/runtime/ and above) import clients/ or server/"
    if imported_layer is not None and importer_layer != imported_layer:
        if importer == "fedps" and imported_layer == "fedps.runtime":
            return None  # the API's front door names the runtime's API
        if importer_layer is None or _LAYERS[imported_layer] >= _LAYERS[importer_layer]:
            where = importer_layer or "the core and the roles"
            return f"{where} imports no layer at or above {imported_layer}"
    importer_part, imported_part = _part(importer), _part(imported)
    if (
        importer_part is not None
        and imported_part not in (None, importer_part)
        and imported_part not in _CORE_PARTS[importer_part]
    ):
        return f"{importer_part} does not import {imported_part} (the core's parts)"
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
        ("fedps.rpc.transport", "server.serve", "composition layers"),
        ("crypto.params", "clients", "crypto/"),
        ("fedps.cli.app", "server.serve", None),
        ("fedps.runtime.demo", "clients.edge_client", None),
        ("server.serve", "fedps.config", None),
        ("fedps.rpc.transport", "grpc", None),
        ("fedps", "fedps.runtime.api", None),
        ("fedps", "fedps.cli.app", "at or above fedps.cli"),
        ("fedps.config", "fedps.runtime.api", "at or above fedps.runtime"),
        ("server.serve", "fedps.runtime.deployment", "at or above fedps.runtime"),
        ("fedps.runtime.demo", "fedps.dashboard", "at or above fedps.dashboard"),
        ("fedps.runtime.demo", "fedps.cli.app", "at or above fedps.cli"),
        ("fedps.bench.benchmark", "fedps.runtime.demo", None),
        ("fedps.bench.benchmark", "fedps.experiments.experiment", "at or above"),
        ("fedps.dashboard.run_launcher", "fedps.runtime.local_cluster", None),
        ("fedps.experiments.report", "fedps.experiments.experiment", None),
        ("fedps.cli.app", "fedps.dashboard", None),
        ("fedps.rpc.model_reader", "fedps.sharding.blocks", None),
        ("fedps.rpc.messages", "fedps.learning.tasks", "does not import fedps.learning"),
        ("fedps.learning.tasks", "fedps.rpc.messages", "does not import fedps.rpc"),
        ("fedps.storage.record_log", "fedps.sharding.blocks", "does not import"),
        ("fedps.learning.tasks", "fedps.config", None),
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
