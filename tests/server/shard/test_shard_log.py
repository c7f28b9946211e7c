"""Tests for server.shard.shard_log: a restarted shard rebuilds exactly what it acknowledged."""

from __future__ import annotations

from pathlib import Path

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
