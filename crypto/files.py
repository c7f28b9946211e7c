"""Atomic file writes: the one way fedps writes a file that must survive a crash.

Every role writes through these helpers: keys and tokens (:func:`write_private`), certificates,
the key holder's state, the coordinator's checkpoint, a shard's published blocks, a client's
privacy ledger. They live in ``crypto/`` because the secret key is their most demanding user
and ``crypto/`` may import nothing of ours but :mod:`fedps.errors`; every other package may
import ``crypto/``.

:func:`atomic_writer` hands out a temporary file beside the target; when its block ends it
fsyncs the file, renames it over the target and fsyncs the folder. If the process dies at any
moment before that, the target holds exactly what it held before (at most a stray
``.NAME.XXXXXXXX.tmp`` is left beside it); once the block has ended, the new content is on
disk, rename included. :func:`write_atomic` writes bytes that way.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_writer", "fsync_directory", "write_atomic", "write_private"]


@contextmanager
def atomic_writer(
    path: Path, *, mode: int | None = None, exclusive: bool = False
) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the block ends without an exception.

    The file is a temporary file in ``path``'s folder; at the end of the block it is flushed,
    fsynced, renamed over ``path`` and the folder fsynced. An exception inside the block (or
    while replacing) removes the temporary file and leaves ``path`` as it was.

    Parameters
    ----------
    path
        The file to replace (its folder must exist).
    mode
        Exactly this mode (e.g. ``0o600`` for a key: never readable by others, not even
        briefly, whatever the umask); ``None``: the umask's default.
    exclusive
        Create ``path`` only if it does not exist (a hard link of the temporary file, which
        fails atomically when it does): of two processes creating one file, exactly one wins.

    Raises
    ------
    FileExistsError
        With ``exclusive``, when ``path`` already exists (it is left as it was).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            os.link(tmp, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_atomic(
    path: Path, data: bytes, *, mode: int | None = None, exclusive: bool = False
) -> None:
    """Replace ``path`` with ``data``: write a temporary file, fsync, rename, fsync the folder.

    Parameters and errors as :func:`atomic_writer`.
    """
    with atomic_writer(path, mode=mode, exclusive=exclusive) as fh:
        fh.write(data)


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write a secret (a key, a token) to ``path`` with mode 0600, atomically: never readable
    by others, not even briefly, whatever the umask.

    ``exclusive``: only if ``path`` does not exist (:class:`FileExistsError` otherwise).
    """
    write_atomic(path, data, mode=0o600, exclusive=exclusive)


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
