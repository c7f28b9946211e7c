"""Atomic, verified file writes: the one way fedps writes a file that must survive a crash.

Every role writes through these helpers: keys and tokens (:func:`write_private`), certificates,
the state files (:func:`write_checked`), a shard's and the key holder's logs
(:func:`write_all`). They live in ``crypto/`` because the secret key is their most demanding
user and ``crypto/`` may import nothing of ours but :mod:`fedps.errors`; every other package
may import ``crypto/``.

:func:`atomic_writer` hands out a temporary file beside the target; when its block ends it
fsyncs the file, renames it over the target and fsyncs the folder. If the process dies at any
moment before that, the target holds exactly what it held before (at most a stray
``.NAME.XXXXXXXX.tmp`` is left beside it); once the block has ended, the new content is on
disk, rename included. :func:`write_atomic` writes bytes that way.

State files (the key holder's state, the coordinator's checkpoint, a shard's published model
and public contexts) are written by :func:`write_checked` in a checked format: the magic
``FEDPS1\\n``, the payload's length (8 bytes, little-endian), its SHA-256, then the payload.
:func:`read_checked` verifies all three and raises :class:`~fedps.errors.CorruptStateError`
with one line that names the file, what is wrong and how to recover: a flipped bit or a cut
file stops the role instead of loading damaged state. A file written before this format (no
header) is accepted only where its reader names the old format's own magic
(``legacy_prefix``, e.g. an ``.npz``'s ``PK\\x03\\x04``), with a WARNING, and is rewritten in
the checked format at the next save.

Fault injection (a test hook): every write of a state file or log record passes through
:func:`write_all`. When the environment variable ``FEDPS_INJECT_FAULTS`` holds a
comma-separated list of ``fnmatch`` patterns (``model.pb,round-*.wal``), the first write to a
file whose base name matches each pattern writes about half its bytes, then fails with
``OSError(ENOSPC)``: once per pattern per process (:func:`reset_faults` re-arms them);
``PATTERN@N`` fails the N-th matching write instead of the first. The first write while the
variable is set logs a WARNING that faults are armed.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import logging
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol

from fedps.errors import CorruptStateError

__all__ = [
    "FAULTS_VARIABLE",
    "atomic_writer",
    "fsync_directory",
    "read_checked",
    "reset_faults",
    "write_all",
    "write_atomic",
    "write_checked",
    "write_private",
]

_log = logging.getLogger("fedps")

#: The environment variable that arms fault injection (a test hook, see the module docstring).
FAULTS_VARIABLE = "FEDPS_INJECT_FAULTS"

_MAGIC = b"FEDPS1\n"
_CHECKED = struct.Struct(f"<{len(_MAGIC)}sQ32s")  # magic, payload length, SHA-256 of payload


class _Sink(Protocol):
    """A file open for writing (buffered or raw)."""

    def write(self, data: memoryview, /) -> int | None: ...

    def flush(self) -> None: ...


class _Faults:
    """Which patterns of :data:`FAULTS_VARIABLE` have fired in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.matched: dict[str, int] = {}  # writes that matched each entry so far
        self.warned = False

    def strike(self, path: Path) -> bool:
        """Whether this write to ``path`` is the one to fail: the first match of an entry
        ``PATTERN``, the N-th of an entry ``PATTERN@N``."""
        spec = os.environ.get(FAULTS_VARIABLE, "")
        if not spec:
            return False
        with self.lock:
            if not self.warned:
                self.warned = True
                _log.warning("fault injection is armed (%s=%s): a test hook", FAULTS_VARIABLE, spec)
            strike = False
            for entry in (e.strip() for e in spec.split(",")):
                pattern, _, nth = entry.partition("@")
                if pattern and fnmatch.fnmatch(path.name, pattern):
                    self.matched[entry] = self.matched.get(entry, 0) + 1
                    strike |= self.matched[entry] == int(nth or 1)
            return strike


_faults = _Faults()


def reset_faults() -> None:
    """Re-arm every pattern of :data:`FAULTS_VARIABLE` (for tests: each one fires once per
    process otherwise)."""
    global _faults
    _faults = _Faults()


def write_all(fh: _Sink, path: Path, *chunks: bytes | memoryview) -> None:
    """Write every byte of ``chunks``, in order, to ``fh``, a file open for ``path``.

    The one place state files and log records are written, so that the fault-injection hook
    (:data:`FAULTS_VARIABLE`) sees every such write.

    Raises
    ------
    OSError
        The write failed (``ENOSPC`` when injected: about half of the bytes were written and
        flushed first, as a full disk does).
    """
    views = [memoryview(chunk) for chunk in chunks]
    if _faults.strike(path):
        budget = sum(len(v) for v in views) // 2
        for view in views:
            _write(fh, view[:budget])
            budget -= min(budget, len(view))
        fh.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    for view in views:
        _write(fh, view)


def _write(fh: _Sink, view: memoryview) -> None:
    while view:
        written = fh.write(view)
        if not written:  # a raw file that took nothing: treat it as a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


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
        write_all(fh, path, data)


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write a secret (a key, a token) to ``path`` with mode 0600, atomically: never readable
    by others, not even briefly, whatever the umask.

    ``exclusive``: only if ``path`` does not exist (:class:`FileExistsError` otherwise).
    """
    write_atomic(path, data, mode=0o600, exclusive=exclusive)


def write_checked(path: Path, data: bytes | memoryview, *, mode: int | None = None) -> None:
    """Replace the state file ``path`` with ``data`` in the checked format (header with the
    payload's length and SHA-256, then the payload), atomically as :func:`write_atomic`."""
    view = memoryview(data)
    header = _CHECKED.pack(_MAGIC, view.nbytes, hashlib.sha256(view).digest())
    with atomic_writer(path, mode=mode) as fh:
        write_all(fh, path, header, view)


def read_checked(
    path: Path, *, what: str, hint: str, legacy_prefix: bytes | None = None
) -> bytes | None:
    """The payload of the state file ``path`` written by :func:`write_checked`, verified;
    None when the file does not exist.

    Parameters
    ----------
    path
        The state file.
    what
        What the file holds, for the error (``"the published model"``).
    hint
        How the operator recovers, for the error (``"delete it; ..."``).
    legacy_prefix
        The magic of the format the file had before it was checked (``b"PK\\x03\\x04"`` for an
        ``.npz``): such a file is returned unchecked, with a WARNING. None: refused.

    Raises
    ------
    CorruptStateError
        One line naming the file, what is wrong (truncated, checksum mismatch, not a fedps
        state file) and ``hint``.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None

    def corrupt(why: str) -> CorruptStateError:
        return CorruptStateError(f"{path}: {what} is corrupt ({why}); {hint}")

    if not raw.startswith(_MAGIC):
        if legacy_prefix is not None and raw.startswith(legacy_prefix):
            _log.warning(
                "%s: %s has no checksum (written before checked state files); loading it "
                "unchecked, the next save adds one",
                path,
                what,
            )
            return raw
        if _MAGIC.startswith(raw):  # empty, or cut inside the magic
            raise corrupt(f"truncated: {len(raw)} bytes")
        raise corrupt("not a fedps state file: no FEDPS1 header")
    if len(raw) < _CHECKED.size:
        raise corrupt(f"truncated: {len(raw)} bytes, shorter than its header")
    _, length, digest = _CHECKED.unpack_from(raw)
    payload = raw[_CHECKED.size :]
    if len(payload) < length:
        raise corrupt(f"truncated: {len(payload)} of {length} bytes")
    if len(payload) > length:
        raise corrupt(f"{len(payload) - length} bytes past its recorded end")
    if hashlib.sha256(payload).digest() != digest:
        raise corrupt("checksum mismatch")
    return payload


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
