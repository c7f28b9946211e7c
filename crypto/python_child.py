"""How fedps starts a Python process of its own (a role, an encryption worker).

``python -P``: the working directory is not put first on the child's path, so a user's
``crypto.py`` or ``server.py`` there cannot stand in for fedps's packages; and the folder that
holds the fedps this process runs goes first on the child's ``PYTHONPATH``, so the child imports
the same fedps (a checkout run from its own folder included). The child learns who started it
(``FEDPS_PARENT_PID``) and stops once that process is gone (:func:`watch_parent`), whatever
killed it: nothing fedps starts outlives it.
"""

from __future__ import annotations

import os
import signal
import site
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PARENT_VARIABLE", "child_environment", "python_command", "watch_parent"]

#: The environment variable that tells a child the process id of the fedps process that
#: started it.
PARENT_VARIABLE = "FEDPS_PARENT_PID"

_HOME = Path(__file__).resolve().parent.parent
"""The folder holding ``crypto/`` and, beside it, fedps's other top-level packages."""


def python_command(*args: str) -> list[str]:
    """``python -P ARGS`` with this process's interpreter."""
    return [sys.executable, "-P", *args]


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child started by :func:`python_command`.

    The folder holding fedps's packages first on its ``PYTHONPATH`` (an installation in
    site-packages is found there anyway and is not added), and this process's id in
    :data:`PARENT_VARIABLE`, for the child's :func:`watch_parent`.
    """
    child = dict(os.environ if env is None else env)
    child[PARENT_VARIABLE] = str(os.getpid())
    home = str(_HOME)
    if home in {*site.getsitepackages(), site.getusersitepackages()}:
        return child
    paths = [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p]
    if home not in paths:
        child["PYTHONPATH"] = os.pathsep.join([home, *paths])
    return child


def watch_parent(*, poll_s: float = 0.5, grace_s: float = 3.0) -> None:
    """Stop this process once the fedps process that started it is gone.

    A child started with :func:`child_environment` knows its parent's id; a daemon thread
    checks every ``poll_s`` seconds that the parent is still the one, and once it is not
    (SIGKILL, a crash, ``timeout``), sends this process SIGTERM, so it stops the way its
    operator's SIGTERM stops it (a role finishes its last write and exits), and SIGKILL if it
    still runs ``grace_s`` seconds later. The variable is removed from this process's
    environment, so what it starts in turn is watched against it, not against its parent.
    Without the variable (a process started by hand) nothing is watched.

    Parameters
    ----------
    poll_s
        How often the parent is checked.
    grace_s
        How long this process may take to stop once its parent is gone.
    """
    value = os.environ.pop(PARENT_VARIABLE, "")
    if not value.isdigit():
        return
    parent = int(value)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)  # a process that stopped in time ends this thread with it
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
