"""Tests for server.shard.shard_log: a restarted shard rebuilds exactly what it acknowledged."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedps.errors import CorruptStateError
from fedps.proto import shard_pb2
from fedps.rpc.shard_messages import PushBatch
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


@pytest.mark.parametrize(
    ("blocks", "multiplier"),
    [
        ([], 1),
        ([(0, b"")], 1),
        ([(0, b"\x01" * 300), (127, b"\x02" * 19_996), (128, b"\x03" * 70_000)], 1),
        ([(5, b"\x04" * 20)], 300),
    ],
)
def test_a_logged_push_reads_back_as_its_protobuf_record(
    tmp_path: Path, blocks: list[tuple[int, bytes]], multiplier: int
) -> None:
    # Prepare: the record assembled around the ciphertexts, and the one protobuf makes
    roots = (b"r" * 32, b"t" * 32)
    push = PushBatch("client-0", 3, 2, 0.5, "ctx", blocks, b"n" * 16, b"s" * 64, roots)
    record = ShardLogRecord("push", 3, push=push, multiplier=multiplier)
    log = ShardLog(tmp_path, fsync=False)
    # Execute
    log.append(3, record)
    # Assert
    assert shard_pb2.ShardLogRecord.FromString(record.serialize()) == record.to_proto()
    assert [rec for _, rec in ShardLog(tmp_path).records()] == [record]
    wanted = {("client-0", b) for b, _ in blocks}
    assert log.pushed(3, wanted) == {("client-0", b): data for b, data in blocks}
