"""The processes a test started that are still running, found by a marker, not by family.

A process that outlived its parent was adopted by another one (init, a subreaper), so its
parent's id no longer says who started it. The processes a test starts (and everything they
start in turn) carry the marker of :func:`marked_environment` in their environment instead,
which every child inherits: :func:`processes_left` finds them all, wherever they went. Linux
only (``/proc``).
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from fedps.runtime.sweeper import processes_with

__all__ = [
    "MARK_VARIABLE",
    "LeftProcess",
    "kill_left",
    "marked_environment",
    "processes_left",
]

#: The environment variable that marks the processes of one test.
MARK_VARIABLE = "FEDPS_TEST_MARK"


@dataclass(frozen=True)
class LeftProcess:
    """A marked process still running: its id and its command line."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"{self.pid} {self.command}"


def marked_environment(env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """``env`` (default: this process's) with a new marker; returns it and the marker."""
    mark = secrets.token_hex(8)
    return {**(os.environ if env is None else env), MARK_VARIABLE: mark}, mark


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:  # gone meanwhile
        return ""


def processes_left(mark: str) -> list[LeftProcess]:
    """Every running process whose environment carries ``mark`` (zombies are not running)."""
    return [LeftProcess(pid, _command(pid)) for pid in processes_with(f"{MARK_VARIABLE}={mark}")]


def kill_left(mark: str) -> None:
    """SIGKILL every process with ``mark`` (what a failed test left)."""
    for process in processes_left(mark):
        with suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
