"""How fedps starts a Python process of its own (a role, an encryption worker).

``python -P``: the working directory is not put first on the child's path, so a user's
``crypto.py`` or ``server.py`` there cannot stand in for fedps's packages; and the folder that
holds the fedps this process runs goes first on the child's ``PYTHONPATH``, so the child imports
the same fedps (a checkout run from its own folder included).
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["child_environment", "python_command"]

_HOME = Path(__file__).resolve().parent.parent
"""The folder holding ``crypto/`` and, beside it, fedps's other top-level packages."""


def python_command(*args: str) -> list[str]:
    """``python -P ARGS`` with this process's interpreter."""
    return [sys.executable, "-P", *args]


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child started by :func:`python_command`.

    The folder holding fedps's packages first on its ``PYTHONPATH``. An installation in
    site-packages is found there anyway and is not added.
    """
    child = dict(os.environ if env is None else env)
    home = str(_HOME)
    if home in {*site.getsitepackages(), site.getusersitepackages()}:
        return child
    paths = [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p]
    if home not in paths:
        child["PYTHONPATH"] = os.pathsep.join([home, *paths])
    return child
