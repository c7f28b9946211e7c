"""Tests for server.shard.shard_log: a restarted shard rebuilds exactly what it acknowledged."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedps.errors import CorruptStateError
from server.shard.shard_log import ShardLog, ShardLogRecord


def test_log_round_trip_and_forget(tmp_path: Path) -> None:
    # Prepare
    log = ShardLog(tmp_path, fsync=False)
    for round_ in (1, 2, 3):
        log.append(round_, ShardLogRecord("close", round_))
    # Execute
    log.forget_before(3)
    # Assert
    assert [(r, rec.round) for r, rec in ShardLog(tmp_path).records()] == [(3, 3)]


def test_a_saved_context_round_trips_and_a_damaged_one_is_refused(tmp_path: Path) -> None:
    # Prepare
    log = ShardLog(tmp_path)
    log.save_context("ctx-1", b"public context bytes")
    saved = log.load_context("ctx-1")
    path = tmp_path / "contexts" / "ctx-1.ctx"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(data)

    # Execute / Assert
    with pytest.raises(CorruptStateError, match=r"public context ctx-1 is corrupt \(checksum"):
        log.load_context("ctx-1")
    assert saved == b"public context bytes"
    assert log.load_context("ctx-2") is None
