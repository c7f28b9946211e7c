r"""Atomic, verified, private writes: the one way fedps writes a file that must survive a crash.

Every role writes through these helpers: keys and tokens (:func:`write_private`), certificates,
the state files (:func:`write_checked`), a shard's and the key holder's logs
(:func:`write_all`). They live in ``crypto/`` because the secret key is their most demanding
user and ``crypto/`` may import nothing of ours but :mod:`fedps.errors`; every other package
may import ``crypto/``.

Everything fedps keeps is its owner's alone, whatever the process's umask: every folder of
state is created by :func:`private_directory` (mode 0700), every file written here is 0600,
and a file appended to or locked in place (a log, a lock file) is opened through
:func:`private_opener` (0600). The key holder's commit logs, for one, hold every client's
sketches: linear equations in the round's secret challenge.

:func:`atomic_writer` hands out a temporary file beside the target; when its block ends it
fsyncs the file, renames it over the target and fsyncs the folder. If the process dies at any
moment before that, the target holds exactly what it held before (at most a stray
``.NAME.XXXXXXXX.tmp`` is left beside it); once the block has ended, the new content is on
disk, rename included. :func:`write_atomic` writes bytes that way.

State files (the key holder's state, the coordinator's checkpoint, a shard's published model
and public contexts) are written by :func:`write_checked` in a checked format: the magic
``FEDPS1\n``, the payload's length (8 bytes, little-endian), its SHA-256, then the payload.
:func:`read_checked` verifies all three and raises :class:`~fedps.errors.CorruptStateError`
with one line that names the file, what is wrong and how to recover: a flipped bit or a cut
file stops the role instead of loading damaged state. A file written before this format (no
header) is accepted only where its reader names the old format's own magic
(``legacy_prefix``, e.g. an ``.npz``'s ``PK\x03\x04``), with a WARNING, and is rewritten in
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
import stat
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
    "check_key",
    "fsync_directory",
    "private_directory",
    "private_opener",
    "read_checked",
    "reset_faults",
    "write_all",
    "write_atomic",
    "write_checked",
    "write_key",
    "write_private",
]

_log = logging.getLogger("fedps")

#: The environment variable that arms fault injection (a test hook, see the module docstring).
FAULTS_VARIABLE = "FEDPS_INJECT_FAULTS"

_FILE_MODE = 0o600  # every file fedps writes: its owner's alone
_DIRECTORY_MODE = 0o700  # every folder of state it creates

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
        """Whether this write to ``path`` is the one to fail.

        The first match of an entry ``PATTERN``, the N-th of an entry ``PATTERN@N``.
        """
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
    """Re-arm every pattern of :data:`FAULTS_VARIABLE`.

    For tests: each one fires once per process otherwise.
    """
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
def atomic_writer(path: Path, *, exclusive: bool = False) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the block ends without an exception.

    The file is a temporary file in ``path``'s folder, mode 0600 from its creation (never
    readable by others, not even briefly, whatever the umask); at the end of the block it is
    flushed, fsynced, renamed over ``path`` and the folder fsynced. An exception inside the
    block (or while replacing) removes the temporary file and leaves ``path`` as it was.

    Parameters
    ----------
    path
        The file to replace (its folder must exist).
    exclusive
        Create ``path`` only if it does not exist (a hard link of the temporary file, which
        fails atomically when it does): of two processes creating one file, exactly one wins.

    Raises
    ------
    FileExistsError
        With ``exclusive``, when ``path`` already exists (it is left as it was).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = private_opener(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
    try:
        with os.fdopen(fd, "wb") as fh:
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


def write_atomic(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Replace ``path`` with ``data`` (mode 0600).

    Write a temporary file, fsync, rename, fsync the folder.

    Parameters and errors as :func:`atomic_writer`.
    """
    with atomic_writer(path, exclusive=exclusive) as fh:
        write_all(fh, path, data)


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write a secret (a key, a token) to ``path`` with mode 0600, atomically.

    Never readable by others, not even briefly, whatever the umask (as every file
    :func:`write_atomic` writes; the name says what the caller relies on).

    ``exclusive``: only if ``path`` does not exist (:class:`FileExistsError` otherwise).
    """
    write_atomic(path, data, exclusive=exclusive)


def _checksum_path(path: Path) -> Path:
    """Where the checksum of the raw key in ``path`` is kept: beside it, ``NAME.sha256``."""
    return path.with_name(path.name + ".sha256")


def write_key(path: Path, raw: bytes, *, exclusive: bool = False) -> None:
    """Write a raw key to ``path`` (as :func:`write_private`), and its SHA-256 beside it.

    Raw keys have no structure to tell a damaged one from a good one; the checksum does
    (:func:`check_key`).
    """
    write_private(path, raw, exclusive=exclusive)
    write_private(_checksum_path(path), hashlib.sha256(raw).hexdigest().encode() + b"\n")


def check_key(path: Path, raw: bytes, *, size: int, what: str) -> None:
    """Check the raw key ``raw`` read from ``path``: its length, and the checksum beside it.

    A key written before checksums were (no ``NAME.sha256``) gets one now.

    Raises
    ------
    CorruptStateError
        The key is not ``size`` bytes, or does not match its checksum: one line naming the file.
    """
    if len(raw) != size:
        raise CorruptStateError(
            f"{what} {path} is corrupt: {len(raw)} bytes, not {size}; restore it from a backup"
        )
    digest = hashlib.sha256(raw).hexdigest()
    sums = _checksum_path(path)
    try:
        kept = sums.read_bytes().decode("ascii", "replace").strip()
    except FileNotFoundError:
        write_private(sums, digest.encode() + b"\n")
        return
    if not secrets.compare_digest(kept, digest):
        raise CorruptStateError(
            f"{what} {path} is corrupt: it does not match its checksum {sums.name}; restore "
            "both from a backup"
        )


def write_checked(path: Path, data: bytes | memoryview) -> None:
    """Replace the state file ``path`` with ``data`` in the checked format.

    The format is a header with the payload's length and SHA-256, then the payload; written
    atomically and with mode 0600 as :func:`write_atomic`.
    """
    view = memoryview(data)
    header = _CHECKED.pack(_MAGIC, view.nbytes, hashlib.sha256(view).digest())
    with atomic_writer(path) as fh:
        write_all(fh, path, header, view)


def read_checked(
    path: Path, *, what: str, hint: str, legacy_prefix: bytes | None = None
) -> bytes | None:
    r"""The payload of the state file ``path`` written by :func:`write_checked`, verified.

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
        The magic of the format the file had before it was checked (``b"PK\x03\x04"`` for an
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


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open(path, flags)`` for a file only its owner may read or write.

    A new file is created 0600 and an existing one (written before this rule, or by hand) is set to
    0600, whatever the umask.

    The ``opener`` of :func:`open` for a file fedps keeps open (a log it appends to)::

        open(path, "ab", buffering=0, opener=private_opener)

    or called directly for a descriptor (a lock file). Returns the descriptor.
    """
    fd = os.open(path, flags, _FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != _FILE_MODE:
            os.fchmod(fd, _FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_directory(path: Path) -> Path:
    """Make ``path`` a folder only its owner may enter.

    Create it and every missing folder above it with mode 0700, whatever the umask, and set an
    existing ``path`` to 0700 (folders above it that exist already are left as they are). Returns
    ``path``.

    Every folder of state is made this way: a role's state folder and those in it (keys,
    commit and shard logs, contexts, the process logs), a client's, the certificates'. An
    existing ``path`` that cannot be changed (another user's, a read-only mount) stays as it
    is, with a WARNING.

    Raises
    ------
    OSError
        ``path`` cannot be created (``FileExistsError``: a file is in its place).
    """
    missing: list[Path] = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(_DIRECTORY_MODE)
        except FileExistsError:  # another process made it first
            if not folder.is_dir():
                raise
        os.chmod(folder, _DIRECTORY_MODE)  # exactly: mkdir's mode is cut by the umask
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode != _DIRECTORY_MODE:
        try:
            os.chmod(path, _DIRECTORY_MODE)
        except OSError as exc:
            _log.warning(
                "state folder %s has mode %04o and cannot be made 0700 (%s); chmod 700 it",
                path,
                mode,
                exc.strerror or exc,
            )
    return path
