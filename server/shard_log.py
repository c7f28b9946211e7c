"""A shard's durable state: a write-ahead log per round, the published model, public contexts.

A shard acknowledges a push only after the push is in its log: each accepted change (round
opened, blocks added, round closed or discarded) is appended as one framed record
(``length, crc32, ShardLogRecord``) to ``log/round-NNNNNNNNNNNN.wal`` and, with ``fsync``
on (the default), flushed to disk before the RPC returns. A restarted shard replays the
logs in round order and rebuilds its running sums and manifests exactly: a record is either
whole (its CRC matches) or it was never acknowledged, so a torn last record is cut off.
Rounds the shard no longer keeps are deleted with their log. The published model (already
signed by the key holder) and the public contexts the shard fetched are written atomically
(write, fsync, rename) beside the logs. Nothing here is secret: ciphertexts under a public
key, signed plaintext model blocks and public contexts.
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

from fedps.proto import shard_pb2

__all__ = ["ShardLog"]

_log = logging.getLogger("fedps")

_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_RECORD = 64 << 20
_NAME = re.compile(r"round-(\d{12})\.wal")
_SAFE_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ShardLog:
    """Append-only, checksummed records of one shard, one file per round.

    Parameters
    ----------
    directory
        The shard's state directory (created if missing).
    fsync
        Flush every record to disk before it is acknowledged (``False`` survives a process
        crash, not a power loss).
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = directory
        self._logs = directory / "log"
        self._contexts = directory / "contexts"
        self._logs.mkdir(parents=True, exist_ok=True)
        self._contexts.mkdir(exist_ok=True)
        self._fsync = fsync
        self._files: dict[int, BinaryIO] = {}

    # ------------------------------------------------------------------ round logs
    def _path(self, round_: int) -> Path:
        return self._logs / f"round-{round_:012d}.wal"

    def append(self, round_: int, record: shard_pb2.ShardLogRecord) -> None:
        """Append one record to ``round_``'s log; durable when this returns."""
        payload = record.SerializeToString()
        fh = self._files.get(round_)
        if fh is None:
            fh = self._files[round_] = open(self._path(round_), "ab")  # noqa: SIM115
        fh.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        fh.flush()
        if self._fsync:
            os.fsync(fh.fileno())

    def records(self) -> Iterator[tuple[int, shard_pb2.ShardLogRecord]]:
        """Every logged record, in round order then write order.

        A torn or corrupt tail (a record that was being written when the process died, so
        never acknowledged) is cut off the file.
        """
        rounds = sorted(
            int(m.group(1)) for p in self._logs.iterdir() if (m := _NAME.fullmatch(p.name))
        )
        for round_ in rounds:
            path = self._path(round_)
            data = path.read_bytes()
            offset = 0
            while offset < len(data):
                good = offset
                if offset + _HEADER.size > len(data):
                    break
                length, crc = _HEADER.unpack_from(data, offset)
                offset += _HEADER.size
                payload = data[offset : offset + length]
                if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
                    offset = good
                    break
                offset += length
                record = shard_pb2.ShardLogRecord()
                record.ParseFromString(payload)
                yield round_, record
            if offset < len(data):
                _log.warning(
                    "%s: cutting %d bytes of an unfinished record", path.name, len(data) - offset
                )
                with open(path, "r+b") as fh:
                    fh.truncate(offset)

    def forget_before(self, round_: int) -> None:
        """Delete the logs of every round before ``round_``."""
        for path in self._logs.iterdir():
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

    # ------------------------------------------------------------------ snapshots
    def save_model(self, request: shard_pb2.PublishRequest) -> None:
        """Replace the saved published model (every owned block, signed), atomically."""
        _write_atomic(self.directory / "model.pb", request.SerializeToString())

    def load_model(self) -> shard_pb2.PublishRequest | None:
        """The last saved published model, or None."""
        path = self.directory / "model.pb"
        if not path.exists():
            return None
        request = shard_pb2.PublishRequest()
        request.ParseFromString(path.read_bytes())
        return request

    def save_context(self, context_id: str, data: bytes) -> None:
        """Keep a fetched public context (public data) for a restart."""
        if _SAFE_ID.fullmatch(context_id):
            _write_atomic(self._contexts / f"{context_id}.ctx", data)

    def load_context(self, context_id: str) -> bytes | None:
        """A saved public context, or None."""
        if not _SAFE_ID.fullmatch(context_id):
            return None
        path = self._contexts / f"{context_id}.ctx"
        return path.read_bytes() if path.exists() else None
