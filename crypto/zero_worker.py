"""A worker process that draws fresh encryptions of zero under a public context.

It is a Python process of its own (running :func:`main`), never a ``multiprocessing``
child: those import the parent's ``__main__`` again, so a user's script without an
``if __name__ == "__main__":`` guard would run a second time in every worker.

The parent writes the serialised public context once, then one request per draw (the count,
8 bytes little-endian); the worker answers each with the ``.npy`` bytes of the zeros, prefixed
by their length. The worker ends when its input closes or its parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO

import numpy as np

from crypto.python_child import child_environment, python_command

__all__ = ["ZeroWorker"]

_LENGTH = 8
# Not ``-m crypto.zero_worker``: the package imports this module first, and runpy warns.
_MAIN = "from crypto.zero_worker import main; main()"


def _write(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(_LENGTH, "little") + payload)
    stream.flush()


def _read(stream: IO[bytes]) -> bytes | None:
    """One length-prefixed message, or None at the end of the stream."""
    header = stream.read(_LENGTH)
    if len(header) < _LENGTH:
        return None
    size = int.from_bytes(header, "little")
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return payload


class ZeroWorker:
    """One worker process and the calls to it, one at a time.

    Parameters
    ----------
    context
        The serialised public context (:meth:`crypto.public_context.PublicContext.serialize`).
    low_priority
        Run at nice 10, to draw with what training leaves over.
    """

    def __init__(self, context: bytes, *, low_priority: bool = False) -> None:
        self._proc = subprocess.Popen(
            # -P and the parent's fedps: a user's crypto.py where the client runs (which the
            # ``fedps`` command never put on its own path) cannot stand in for fedps's package
            python_command("-c", _MAIN, "10" if low_priority else "0"),
            env=child_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="zero-worker")  # one at a time
        assert self._proc.stdin is not None
        try:
            _write(self._proc.stdin, context)
        except OSError:
            self.close()
            raise

    def submit(self, count: int) -> Future[np.ndarray]:
        """Draw ``count`` encryptions of zero in the worker (after any earlier draw)."""
        return self._calls.submit(self._draw, count)

    def _draw(self, count: int) -> np.ndarray:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        _write(stdin, count.to_bytes(_LENGTH, "little"))
        answer = _read(stdout)
        if answer is None:
            raise RuntimeError(f"the zero worker exited ({self._proc.poll()})")
        zeros: np.ndarray = np.load(io.BytesIO(answer), allow_pickle=False)
        return zeros

    def close(self) -> None:
        """End the worker (a draw in progress is abandoned)."""
        self._calls.shutdown(wait=False, cancel_futures=True)
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._proc.terminate()  # not after the draw in progress: nobody waits for it
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _exit_with_parent() -> None:
    """Ask Linux to end this worker when its parent dies (a killed client leaves no orphan)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    """The worker: read the context, then answer every request until the input closes."""
    _exit_with_parent()
    os.nice(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    from crypto.public_context import PublicContext

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    context = _read(stdin)
    if context is None:
        return
    public = PublicContext.from_bytes(context)
    while (request := _read(stdin)) is not None:
        out = io.BytesIO()
        np.save(out, public.encrypt_zeros(int.from_bytes(request, "little")), allow_pickle=False)
        _write(stdout, out.getvalue())
