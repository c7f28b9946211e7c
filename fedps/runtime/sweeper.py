"""Nothing fedps starts outlives it, even when it is killed: a sweeper cleans up after it.

A process that starts roles (``fedps demo``, ``up``, ``ui``, ``experiment``, a script's
:class:`~fedps.runtime.local_cluster.LocalCluster`) stops them itself when it ends, and removes
its temporary folders; SIGKILL (or the out-of-memory killer) gives it no chance to. So it
starts a sweeper first (:func:`sweep_after_exit`): a small process of its own session that
holds the reading end of a pipe from it. The pipe closes when this process ends, however it
ends; the sweeper then stops every process this one started with
:func:`~crypto.python_child.child_environment` that is still running (SIGTERM, then SIGKILL
after :data:`GRACE_S`), and once they are gone removes the folders of
:func:`temporary_folder` that this process did not remove itself. After a clean end it finds
nothing to do. It finds the children by the parent's id in their environment (``/proc``,
Linux); elsewhere each child still stops by itself once its parent is gone
(:func:`~crypto.python_child.watch_parent`).

This module is the sweeper's program too (:func:`main`): it imports nothing heavy, so the
sweeper is ready as soon as it is started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from fedps.errors import FedPSError

__all__ = ["GRACE_S", "main", "processes_with", "sweep_after_exit", "temporary_folder"]

#: Seconds the children of a process that died get to stop after the sweeper's SIGTERM,
#: before it kills them (a role's graceful stop takes about 2 s).
GRACE_S = 3.0

_MAIN = "from fedps.runtime.sweeper import main; main()"

_lock = threading.Lock()
_sweeper: subprocess.Popen[bytes] | None = None


def sweep_after_exit() -> None:
    """Start this process's sweeper, unless it runs already.

    Call it before starting a child process: once this process has ended, however it ended,
    the children it started and left running are stopped and its temporary folders removed.
    """
    _pipe()


def _pipe() -> subprocess.Popen[bytes]:
    """The sweeper of this process (started on the first call)."""
    global _sweeper
    # here, not at the top: the sweeper runs this module, and crypto's package is slow to import
    from crypto.python_child import PARENT_VARIABLE, child_environment, python_command

    with _lock:
        if _sweeper is None or _sweeper.poll() is not None:
            entry = f"{PARENT_VARIABLE}={os.getpid()}"
            _sweeper = subprocess.Popen(
                python_command("-c", _MAIN, entry),
                stdin=subprocess.PIPE,
                env=child_environment(),
                start_new_session=True,  # a terminal's Ctrl-C or hang-up is for this process
            )
        return _sweeper


def _tell(sign: bytes, folder: Path) -> None:
    """Tell the sweeper to remove ``folder`` (``+``) or that it is no longer its to remove."""
    stdin = _pipe().stdin
    assert stdin is not None
    with _lock, suppress(OSError):  # a sweeper that died (killed by hand) has nothing to do
        stdin.write(sign + os.fsencode(folder) + b"\n")
        stdin.flush()


@contextmanager
def temporary_folder(prefix: str, *, keep_on_error: str = "") -> Iterator[Path]:
    """A new private folder in the temporary directory, removed when the block ends.

    Should this process die first (SIGKILL), its sweeper removes it once the processes this
    one started are gone.

    Parameters
    ----------
    prefix
        The start of the folder's name (``fedps-demo-``).
    keep_on_error
        A path inside the folder that is kept when the block raises a
        :class:`~fedps.errors.FedPSError` (a run's logs, for the error to point at); everything
        else is removed.

    Yields
    ------
    Path
        The folder.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _tell(b"+", folder)
    kept = False
    try:
        yield folder
    except FedPSError:
        kept = bool(keep_on_error) and (folder / keep_on_error).exists()
        raise
    finally:
        if kept:
            _remove_all_but(folder, folder / keep_on_error)
        else:
            shutil.rmtree(folder, ignore_errors=True)
        _tell(b"-", folder)


def _remove_all_but(folder: Path, keep: Path) -> None:
    """Remove everything in ``folder`` but ``keep`` (inside it) and the folders leading to it."""
    for entry in folder.iterdir():
        if entry == keep:
            continue
        if keep.is_relative_to(entry):
            _remove_all_but(entry, keep)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def processes_with(entry: str) -> list[int]:
    """The ids of the running processes but this one whose environment holds ``entry``.

    As they were started (``NAME=VALUE``); empty where ``/proc`` does not say (not Linux).
    Exited processes not yet reaped (zombies) have no environment left and are not listed.
    """
    wanted = os.fsencode(entry)
    found = []
    with suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as environ:
                    if wanted in environ.read().split(b"\0"):
                        found.append(int(name))
            except OSError:  # gone meanwhile, or not ours
                continue
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(entry: str, until: float) -> list[int]:
    """Wait until no process holds ``entry`` or ``until`` (monotonic); returns those left."""
    while (left := processes_with(entry)) and time.monotonic() < until:
        time.sleep(0.05)
    return left


def main() -> None:
    """The sweeper's program: ``argv[1]`` is the entry in the environment of the children.

    It reads the folders to remove (``+PATH``) and those no longer its own (``-PATH``) until
    its parent's end closes the pipe, then stops the children left (SIGTERM, SIGKILL after
    :data:`GRACE_S`) and removes the folders.
    """
    for sig in (signal.SIGINT, signal.SIGHUP):  # the parent's to handle, not the sweeper's
        signal.signal(sig, signal.SIG_IGN)
    entry = sys.argv[1]
    folders: dict[str, None] = {}  # in the order given
    for line in sys.stdin.buffer:
        path = os.fsdecode(line[1:].rstrip(b"\n"))
        if line.startswith(b"+"):
            folders[path] = None
        else:
            folders.pop(path, None)
    _signal_all(processes_with(entry), signal.SIGTERM)
    left = _wait_gone(entry, time.monotonic() + GRACE_S)
    _signal_all(left, signal.SIGKILL)
    _wait_gone(entry, time.monotonic() + GRACE_S)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
