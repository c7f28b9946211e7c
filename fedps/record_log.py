"""Append-only, checksummed records, one file per round (a write-ahead log).

Each record is framed as ``length, crc32, payload`` and, with ``fsync`` on (the default),
flushed to disk before :meth:`RecordLog.append` returns, so whoever acknowledges after
appending acknowledges only what is durable. Reading back cuts a torn or corrupt last record
(one that was being written when the process died, so never acknowledged). The shard logs
its pushes this way (:mod:`server.shard.shard_log`), the key holder its commitments
(:mod:`server.keyholder.commit_board`).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["RecordLog"]

_log = logging.getLogger("fedps")

_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_RECORD = 64 << 20
_NAME = re.compile(r"round-(\d{12})\.wal")


class RecordLog:
    """Per-round logs of byte records in ``directory``.

    Parameters
    ----------
    directory
        Where the ``round-NNNNNNNNNNNN.wal`` files live (created if missing).
    fsync
        Flush every record to disk before :meth:`append` returns (``False`` survives a
        process crash, not a power loss).
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._files: dict[int, BinaryIO] = {}

    def _path(self, round_: int) -> Path:
        return self.directory / f"round-{round_:012d}.wal"

    def append(self, round_: int, payload: bytes) -> None:
        """Append one record to ``round_``'s log; durable when this returns."""
        fh = self._files.get(round_)
        if fh is None:
            fh = self._files[round_] = open(self._path(round_), "ab")  # noqa: SIM115
        fh.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        fh.flush()
        if self._fsync:
            os.fsync(fh.fileno())

    def records(self) -> Iterator[tuple[int, bytes]]:
        """Every record, in round order then write order; a torn tail is cut off."""
        rounds = sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.fullmatch(p.name))
        )
        for round_ in rounds:
            path = self._path(round_)
            data = path.read_bytes()
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, crc = _HEADER.unpack_from(data, offset)
                payload = data[offset + _HEADER.size : offset + _HEADER.size + length]
                if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
                    break
                offset += _HEADER.size + length
                yield round_, payload
            if offset < len(data):
                _log.warning(
                    "%s: cutting %d bytes of an unfinished record", path, len(data) - offset
                )
                with open(path, "r+b") as fh:
                    fh.truncate(offset)

    def forget_before(self, round_: int) -> None:
        """Delete the logs of every round before ``round_``."""
        for path in self.directory.iterdir():
            m = _NAME.fullmatch(path.name)
            if m and int(m.group(1)) < round_:
                fh = self._files.pop(int(m.group(1)), None)
                if fh is not None:
                    fh.close()
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the open log files."""
        for fh in self._files.values():
            fh.close()
        self._files.clear()
