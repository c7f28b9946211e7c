"""Private helpers: move SEAL objects to and from bytes.

TenSEAL's ``sealapi`` binds SEAL's ``save``/``load`` with file paths only, so objects go
through files in a private (mode 0700) directory, in memory (``/dev/shm``) where the system
has it. Each process makes its own directory on first use and removes it when it exits
(``atexit``: a normal exit, ``sys.exit``, or the SIGTERM handlers of fedps's roles). SEAL's
``load`` checks every loaded object against the context (parameters and coefficient range),
so bytes loaded here are validated by SEAL as well as by our own checks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any, Protocol

import zstandard

from fedps.errors import InvalidArgumentError

SEAL_MAGIC = 0xA15E
_HEADER = struct.Struct("<HBBBBHQ")  # magic, header size, major, minor, compr mode, reserved, size
HEADER_SIZE = _HEADER.size
_COMPR_NONE = 0
_COMPR_ZSTD = 2
_MAX_OBJECT_BYTES = 1 << 28

_local = threading.local()
_roots: dict[int, str] = {}  # process id -> its scratch directory
_roots_lock = threading.Lock()


class _Saveable(Protocol):
    def save(self, path: str) -> None: ...


_PREFIX = "fedps-seal-"


def scratch_root() -> str:
    """The scratch directory of this process (mode 0700), made on first use, removed at exit.

    Its name carries the process id (``fedps-seal-PID-...``): a process killed with SIGKILL
    cannot remove its own, so the next one to make its directory removes those of this user's
    processes that no longer exist.
    """
    pid = os.getpid()
    with _roots_lock:
        root = _roots.get(pid)
        if root is None:
            parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            _remove_orphans(parent)
            root = tempfile.mkdtemp(prefix=f"{_PREFIX}{pid}-", dir=parent)
            _roots[pid] = root
            atexit.register(_remove_root, pid, root)
    return root


def _remove_orphans(parent: str) -> None:
    """Remove the scratch directories in ``parent`` of this user's processes that are gone."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        owner, _, _ = entry.name.removeprefix(_PREFIX).partition("-")
        if not entry.name.startswith(_PREFIX) or not owner.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)  # raises once that process is gone
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # another user's process, or the entry went meanwhile
            continue


def _remove_root(pid: int, root: str) -> None:
    # A forked child inherits its parent's exit handlers: only the owner removes a directory.
    if os.getpid() == pid:
        shutil.rmtree(root, ignore_errors=True)


def _scratch_path() -> str:
    # Keyed by process too: forked workers inherit this thread-local.
    key = (os.getpid(), threading.get_ident())
    if getattr(_local, "key", None) != key:
        _local.key = key
        _local.path = os.path.join(scratch_root(), f"obj-{key[1]}")
    path: str = _local.path
    return path


def save_bytes(obj: _Saveable) -> bytes:
    """Serialise a SEAL object with SEAL's own format (possibly compressed)."""
    path = _scratch_path()
    try:
        obj.save(path)
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        _remove(path)


def load_into(obj: Any, context: Any, data: bytes) -> None:
    """Load ``data`` into ``obj`` with SEAL's validating ``load(context, path)``."""
    _load_via_file(data, lambda path: obj.load(context, path))


def load_plain(obj: Any, data: bytes) -> None:
    """Load ``data`` into a SEAL object whose ``load`` takes only a path (parameters)."""
    _load_via_file(data, lambda path: obj.load(path))


def _load_via_file(data: bytes, load: Callable[[str], None]) -> None:
    """Write ``data`` to a private scratch file and ``load`` it; SEAL errors become ours."""
    path = _scratch_path()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            load(path)
        except (RuntimeError, ValueError) as exc:
            raise InvalidArgumentError(f"SEAL refused the object: {exc}") from exc
    finally:
        _remove(path)


def uncompressed_body(data: bytes) -> bytes:
    """Return the body of a SEAL-serialised object without its header, decompressed."""
    if len(data) < HEADER_SIZE:
        raise InvalidArgumentError("SEAL object shorter than its header")
    magic, header_size, _major, _minor, mode, _res, size = _HEADER.unpack_from(data)
    if magic != SEAL_MAGIC or header_size != HEADER_SIZE or size != len(data):
        raise InvalidArgumentError("not a SEAL object (bad header)")
    body = data[HEADER_SIZE:]
    if mode == _COMPR_NONE:
        return body
    if mode == _COMPR_ZSTD:
        try:
            out: bytes = zstandard.ZstdDecompressor().decompress(
                body, max_output_size=_MAX_OBJECT_BYTES
            )
        except zstandard.ZstdError as exc:
            raise InvalidArgumentError(f"corrupt SEAL object: {exc}") from exc
        return out
    raise InvalidArgumentError(f"unsupported SEAL compression mode {mode}")


def with_header(body: bytes, *, version: tuple[int, int] = (4, 3)) -> bytes:
    """Prefix an uncompressed body with a SEAL header."""
    size = HEADER_SIZE + len(body)
    return (
        _HEADER.pack(SEAL_MAGIC, HEADER_SIZE, version[0], version[1], _COMPR_NONE, 0, size) + body
    )


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
