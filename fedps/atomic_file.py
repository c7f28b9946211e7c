"""Atomic file replacement: the one way fedps rewrites a file that must survive a crash.

:func:`write_atomic` writes a temporary file beside the target, fsyncs it, renames it over the
target and fsyncs the directory. If the process dies at any moment before it returns, the
target holds exactly what it held before (at most a stray ``.NAME.XXXXXXXX.tmp`` is left
beside it); once it returns, the new content is on disk, rename included.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["fsync_directory", "write_atomic"]


def write_atomic(
    path: Path, data: bytes, *, mode: int | None = None, exclusive: bool = False
) -> None:
    """Replace ``path`` with ``data``: write a temporary file, fsync, rename, fsync the folder.

    Parameters
    ----------
    path
        The file to replace (its folder must exist).
    data
        The new content.
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
            fh.write(data)
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


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
