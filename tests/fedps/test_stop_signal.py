"""A process asked to stop (fedps/stop_signal.py) cleans up, then ends by the signal it got."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedps.stop_signal import STOP_SIGNALS, stopped_cleanly

_TIMEOUT_S = 60.0


def _run_stopped_by(sig: signal.Signals | None, done: Path) -> subprocess.CompletedProcess[str]:
    """A process that handles the stop signals, gets ``sig`` (if any) and then cleans up."""
    script = (
        "import atexit, pathlib, signal\n"
        "from fedps.stop_signal import end_by_stop_signal, interrupt_on_stop_signals\n"
        f"atexit.register(pathlib.Path({str(done)!r}).touch)\n"
        "interrupt_on_stop_signals()\n"
        "try:\n"
        f"    if {int(sig or 0)}:\n"
        f"        signal.raise_signal({int(sig or 0)})\n"
        "except KeyboardInterrupt:\n"
        "    print('cleaned up')\n"
        "end_by_stop_signal()\n"
        "print('not ended by a signal')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_stopped_process_cleans_up_and_then_ends_by_its_signal(
    sig: signal.Signals, tmp_path: Path
) -> None:
    # Prepare
    done = tmp_path / "exit-function-ran"
    # Execute
    result = _run_stopped_by(sig, done)
    # Assert: its handler unwound it, its exit functions ran, and the signal ended it
    assert result.returncode == -sig, result.stderr
    assert result.stdout == "cleaned up\n"
    assert done.exists()


def test_a_process_that_got_no_signal_goes_on(tmp_path: Path) -> None:
    # Prepare
    done = tmp_path / "exit-function-ran"
    # Execute
    result = _run_stopped_by(None, done)
    # Assert
    assert result.returncode == 0, result.stderr
    assert result.stdout == "not ended by a signal\n"
    assert done.exists()


def test_a_child_stopped_by_a_stop_signal_stopped_cleanly() -> None:
    # Execute / Assert: exit 0 or a stop signal; not an error exit, not SIGKILL or a crash
    assert all(
        stopped_cleanly(code) for code in (0, -signal.SIGTERM, -signal.SIGHUP, -signal.SIGINT)
    )
    assert not any(stopped_cleanly(code) for code in (1, 2, -signal.SIGKILL, -signal.SIGSEGV))
