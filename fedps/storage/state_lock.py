"""One process per role's state directory: an exclusive lock held for the process's life.

Two instances of one role on one state directory would both append to its logs and both
serve a model, so a role takes :class:`StateLock` on its directory before it reads or writes
anything there (:func:`server.serve.serve_forever`). The lock is ``flock(LOCK_EX | LOCK_NB)``
on ``DIRECTORY/.lock``, which holds the pid of the process that has it; the kernel drops the
lock when that process exits, however it exits (SIGKILL included), so a stale file never
blocks a restart. The file itself stays: deleting it would let two processes lock two files
of one name.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from crypto.files import private_directory, private_opener
from fedps.errors import ConfigError

__all__ = ["LOCK_FILE", "StateLock", "StateLockedError"]

#: Name of the lock file in a locked directory.
LOCK_FILE = ".lock"


class StateLockedError(ConfigError):
    """Another process holds the lock of the state directory (a second instance of a role).

    A configuration error, as two roles configured on one ``cluster.state_dir`` are.
    """


class StateLock:
    """The exclusive lock of ``directory`` (made private, 0700, and created if missing).

    :meth:`acquire` takes it or raises :class:`StateLockedError` naming the directory and the
    pid that holds it; :meth:`release` (or leaving the ``with`` block) gives it back.
    Advisory, like every ``flock``: it binds fedps processes, which all take it.

    Parameters
    ----------
    directory
        The role's state directory, such as ``STATE_DIR/shard-0``.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock and write this process's pid into the lock file.

        Raises
        ------
        StateLockedError
            Another process (or another :class:`StateLock` of this process) holds it.
        """
        if self._fd is not None:
            return
        private_directory(self.directory)
        fd = private_opener(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateLockedError(
                f"state directory {self.directory} is locked by another fedps process "
                f"(pid {holder}); stop it, or give this one another cluster.state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (the file stays); nothing if it is not held."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> StateLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
