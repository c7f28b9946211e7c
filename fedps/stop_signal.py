"""A fedps process asked to stop cleans up, then ends by the signal that asked it.

SIGTERM (systemd, ``timeout``, a parent), SIGHUP (a closed terminal) and SIGINT (Ctrl-C) stop
every fedps command and role the same way: it stops what it started and removes its temporary
folders, runs its exit functions, and then ends *by that signal*, its default handler restored
and the signal raised again, as a process without handlers would. A shell sees 128+N (143 after
SIGTERM, 130 after Ctrl-C), a parent sees ``-N`` in ``returncode``, and systemd counts a SIGTERM
as a clean stop. A container's first process, which its own signal cannot end, exits 128+N
instead. A process that stopped for any other reason exits with its own status.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable

__all__ = [
    "STOP_SIGNALS",
    "end_by_stop_signal",
    "interrupt_on_stop_signals",
    "on_stop_signals",
    "stopped_cleanly",
]

#: The signals that ask a fedps process to stop (SIGKILL cannot be handled).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: list[signal.Signals] = []  # the first stop signal this process got, if any


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Call ``stop`` on each of :data:`STOP_SIGNALS`, noting the first that came.

    Only the main thread can set signal handlers.

    Parameters
    ----------
    stop
        What the signal does: set an event, or raise to unwind the main thread.
    """

    def handle(signum: int, frame: object) -> None:
        if not _received:
            _received.append(signal.Signals(signum))
        stop()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def stopped_cleanly(returncode: int) -> bool:
    """Whether a child process that ended with ``returncode`` stopped cleanly.

    Exit 0, or ended by one of :data:`STOP_SIGNALS` (after its clean-up, when it is fedps's).

    Parameters
    ----------
    returncode
        Its :attr:`subprocess.Popen.returncode` (``-N``: ended by signal N).
    """
    return returncode == 0 or -returncode in STOP_SIGNALS


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def interrupt_on_stop_signals() -> None:
    """Each of :data:`STOP_SIGNALS` stops this process as Ctrl-C does: ``KeyboardInterrupt``."""
    on_stop_signals(_raise_keyboard_interrupt)


def end_by_stop_signal() -> None:
    """End this process by the stop signal it got, if it got one; return otherwise.

    Its exit functions run first (they flush the logs and remove its private folders), then the
    signal's default handler is restored and the signal raised again.
    """
    if not _received:
        return
    sig = _received[0]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    signal.raise_signal(sig)
    # Reached only where the signal's default action is ignored: a container's first process
    # (PID 1 of its namespace) cannot be ended by its own signal; it exits as a shell says.
    os._exit(128 + sig)
