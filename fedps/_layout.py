"""fedps's top-level packages beside it, not a user's file of the same name.

fedps ships ``crypto/``, ``clients/`` and ``server/`` as top-level packages next to
``fedps/``. A user's ``server.py`` (or ``server/`` package) in the working directory comes
first on ``sys.path`` and would hide fedps's package, failing later with an import error that
names neither. :func:`check_layout` runs first thing when fedps is imported and says so in one
line instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from fedps.errors import ConfigError

__all__ = ["ShadowedPackageError", "check_layout"]

_PACKAGES = ("clients", "crypto", "server")
_HOME = Path(__file__).resolve().parent.parent
"""The folder holding ``fedps/`` and, beside it, fedps's other top-level packages."""


class ShadowedPackageError(ConfigError, ImportError):
    """A module of the user's hides one of fedps's top-level packages."""


def _shadowing(name: str) -> Path | None:
    """The file or folder that ``import name`` would load instead of fedps's package.

    None when it loads fedps's own (or finds nothing: a partial install fails on its own).
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return None
    if spec is None:
        return None
    if spec.origin is not None and spec.origin not in ("built-in", "frozen", "namespace"):
        origin = Path(spec.origin)
        found = origin.parent if origin.name == "__init__.py" else origin
    elif spec.submodule_search_locations:  # a namespace package: a folder without __init__
        found = Path(next(iter(spec.submodule_search_locations)))
    else:
        return None
    try:
        if found.resolve() == _HOME / name:
            return None
    except OSError:
        pass
    return found


def _shown(path: Path) -> str:
    """``path`` as the user would type it: ``./server.py`` in the working directory."""
    try:
        relative = path.resolve().relative_to(Path.cwd().resolve())
    except (OSError, ValueError):
        return str(path)
    return f".{os.sep}{relative}"


def _running_cli() -> bool:
    """Whether this process is the ``fedps`` command, which reports errors as one line.

    The command is ``fedps ...`` or ``python -m fedps.cli ...``.
    """
    argv = getattr(sys, "orig_argv", sys.argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in ("fedps.cli", "fedps.cli.__main__"):
            return True
    return Path(sys.argv[0]).stem == "fedps" if sys.argv and sys.argv[0] else False


def check_layout() -> None:
    """Check that ``crypto``, ``clients`` and ``server`` are fedps's own packages.

    Only looks the names up (``importlib.util.find_spec``), importing nothing. The ``fedps``
    command prints the error as one line (``fedps: error: ...``) and exits with status 2.

    Raises
    ------
    ShadowedPackageError
        Naming the first user file or folder that hides one of them, and what to do.
    """
    for name in _PACKAGES:
        found = _shadowing(name)
        if found is None:
            continue
        kind = "folder" if found.is_dir() else "file"
        message = (
            f"your {kind} {_shown(found)} hides fedps's {name!r} package; rename it or run "
            "fedps from another directory"
        )
        if _running_cli():
            print(f"fedps: error: {message}", file=sys.stderr)
            raise SystemExit(2)
        raise ShadowedPackageError(message)
