"""Append-only, checksummed records, one file per round (a write-ahead log).

Each record is framed as ``length, crc32, payload`` and, with ``fsync`` on (the default),
flushed to disk before :meth:`RecordLog.append` returns, so whoever acknowledges after
appending acknowledges only what is durable. The shard logs its pushes this way
(:mod:`server.shard.shard_log`), the key holder its commitments
(:mod:`server.keyholder.commit_log`).

All or nothing: an append that cannot be written (a full disk) truncates the file back to
where it was and raises :class:`~fedps.errors.PeerUnavailableError` (the caller retries later;
nothing was acknowledged). If even that truncation fails, the log refuses every later append
until the process restarts, so nothing can land after a torn record.

Reading back tells a torn tail from corruption. A last record cut short (its header or payload
runs past the end of the file) was being written when the process died, so it was never
acknowledged: it is cut off, with a WARNING. A complete record whose checksum or length is
wrong, anywhere in the file, is corruption: nothing is truncated or rewritten, the file stays
in place as it is, a copy is written beside it as ``NAME.corrupt`` and
:class:`~fedps.errors.CorruptStateError` stops the role (cutting there would silently drop
records that were acknowledged). A record whose length field lost one bit, so that it seems
to run past the end of the file, is recognised as corruption too: with that bit restored its
checksum matches.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from crypto.files import private_directory, private_opener, write_all, write_atomic
from fedps.errors import CorruptStateError, PeerUnavailableError

__all__ = ["RecordLog"]

_log = logging.getLogger("fedps")

_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_RECORD = 64 << 20
_NAME = re.compile(r"round-(\d{12})\.wal")
_HINT = "restore the file from a backup, or move it aside to drop what it recorded for that round"


class RecordLog:
    """Per-round logs of byte records in ``directory``.

    Parameters
    ----------
    directory
        Where the ``round-NNNNNNNNNNNN.wal`` files live (created if missing).
    fsync
        Flush every record to disk before :meth:`append` returns (``False`` survives a
        process crash, not a power loss).
    what
        What the log is, for messages (``"shard log"``).
    hint
        How an operator recovers from a corrupt record, for the error.
    """

    def __init__(
        self, directory: Path, *, fsync: bool = True, what: str = "log", hint: str = _HINT
    ) -> None:
        self.directory = directory
        private_directory(directory)
        self._fsync = fsync
        self._what = what
        self._hint = hint
        self._files: dict[int, io.FileIO] = {}
        self._ends: dict[int, int] = {}  # each open file's length after its last good record
        self._broken: str | None = None  # why no append may land any more

    def _path(self, round_: int) -> Path:
        return self.directory / f"round-{round_:012d}.wal"

    def append(self, round_: int, payload: bytes) -> None:
        """Append one record to ``round_``'s log; durable when this returns.

        Raises
        ------
        PeerUnavailableError
            The record could not be written (a full disk): the file is as it was, nothing was
            recorded, the caller may retry later.
        """
        if self._broken is not None:
            raise PeerUnavailableError(self._broken)
        path = self._path(round_)
        fh = self._files.get(round_)
        if fh is None:
            fh = self._files[round_] = open(  # noqa: SIM115
                path, "ab", buffering=0, opener=private_opener
            )
            self._ends[round_] = fh.seek(0, os.SEEK_END)
        end = self._ends[round_]
        try:
            write_all(fh, path, _HEADER.pack(len(payload), zlib.crc32(payload)), payload)
            if self._fsync:
                os.fsync(fh.fileno())
        except OSError as exc:
            self._undo(round_, end, exc)
        self._ends[round_] = end + _HEADER.size + len(payload)

    def _undo(self, round_: int, end: int, exc: OSError) -> NoReturn:
        """Cut ``round_``'s file back to ``end`` after a failed append, then raise."""
        path = self._path(round_)
        fh = self._files[round_]
        reason = exc.strerror or str(exc)
        try:
            os.ftruncate(fh.fileno(), end)
            if self._fsync:
                os.fsync(fh.fileno())
        except OSError as undo:
            del self._files[round_], self._ends[round_]
            with contextlib.suppress(OSError):
                fh.close()
            self._broken = (
                f"{self._what} {path.name}: cannot write ({reason}) nor undo the partial "
                f"write ({undo.strerror or undo}); nothing more is recorded until the role "
                "restarts"
            )
            _log.error("%s", self._broken)
            raise PeerUnavailableError(self._broken) from exc
        _log.warning("%s %s: cannot write (%s); left as it was", self._what, path, reason)
        raise PeerUnavailableError(
            f"{self._what} {path.name}: cannot write ({reason}); nothing was recorded, retry later"
        ) from exc

    def records(self) -> Iterator[tuple[int, bytes]]:
        """Every record, in round order then write order; a torn tail is cut off.

        Raises
        ------
        CorruptStateError
            A complete record is damaged (after the records before it were yielded); the file
            is left as it is and copied to ``NAME.corrupt``.
        """
        rounds = sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.fullmatch(p.name))
        )
        for round_ in rounds:
            path = self._path(round_)
            data = path.read_bytes()
            offset = 0
            while (end := self._record_end(path, data, offset)) is not None:
                yield round_, data[offset + _HEADER.size : end]
                offset = end
            if offset < len(data):
                _log.warning(
                    "%s: cutting a torn last record (%d bytes, never acknowledged)",
                    path,
                    len(data) - offset,
                )
                with open(path, "r+b") as fh:
                    fh.truncate(offset)
                    if self._fsync:
                        os.fsync(fh.fileno())

    def round_records(self, round_: int) -> Iterator[bytes]:
        """The records of ``round_`` written so far, in write order (nothing if it has none).

        Read back without changing the file.

        Raises
        ------
        CorruptStateError
            A complete record is damaged.
        """
        path = self._path(round_)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        offset = 0
        while (end := self._record_end(path, data, offset)) is not None:
            yield data[offset + _HEADER.size : end]
            offset = end

    def _record_end(self, path: Path, data: bytes, offset: int) -> int | None:
        """Where the record at ``offset`` ends; None at the end of the file or a torn tail."""
        start = offset + _HEADER.size
        if start > len(data):
            return None
        length: int
        crc: int
        length, crc = _HEADER.unpack_from(data, offset)
        view = memoryview(data)[start:]
        if length > _MAX_RECORD:
            self._corrupt(path, data, offset, f"impossible length {length}")
        if length > len(view):
            if any(
                (fixed := length ^ (1 << bit)) <= len(view) and zlib.crc32(view[:fixed]) == crc
                for bit in range(32)
            ):
                self._corrupt(path, data, offset, "damaged length")
            return None
        if zlib.crc32(view[:length]) != crc:
            self._corrupt(path, data, offset, "checksum mismatch")
        return start + length

    def _corrupt(self, path: Path, data: bytes, offset: int, why: str) -> NoReturn:
        kept = path.with_name(f"{path.name}.corrupt")
        write_atomic(kept, data)
        raise CorruptStateError(
            f"{path}: corrupt record at byte {offset} ({why}); the role stops so nothing "
            f"acknowledged is lost. Kept for inspection at {kept}. To recover: {self._hint} "
            "(see docs/operations.md)"
        )

    def forget_before(self, round_: int) -> None:
        """Delete the logs of every round before ``round_``."""
        for path in self.directory.iterdir():
            m = _NAME.fullmatch(path.name)
            if m and int(m.group(1)) < round_:
                fh = self._files.pop(int(m.group(1)), None)
                self._ends.pop(int(m.group(1)), None)
                if fh is not None:
                    fh.close()
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the open log files."""
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        self._ends.clear()
