"""Tests for fedps.rpc.model_reader: the model assembled from every shard, every block checked."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from fedps.errors import InvalidArgumentError, RoundClosedError
from fedps.rpc.messages import ParameterBlock
from fedps.rpc.model_reader import ModelReader
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.blocks import BlockLayout

LAYOUT = BlockLayout(num_params=7, values_per_block=4)


class _Shard:
    """A shard that serves the blocks it was given."""

    def __init__(self, blocks: list[ParameterBlock]) -> None:
        self.blocks = blocks

    def pull_blocks(self, min_version: int = 0, *, timeout_s: float = 0.0) -> list[ParameterBlock]:
        return self.blocks


def _block(block: int, version: int, signature: bytes = b"ok") -> ParameterBlock:
    values = np.arange(4, dtype="<f4") + 10 * block
    return ParameterBlock(block, version, values.tobytes(), signature)


def _reader(served: dict[str, list[ParameterBlock]]) -> ModelReader:
    """A reader of fake shards that serve ``served``."""
    reader = ModelReader({sid: "127.0.0.1:1" for sid in served})
    reader.close()
    fakes = {sid: _Shard(blocks) for sid, blocks in served.items()}
    reader.shards = cast(dict[str, ShardStub], fakes)
    return reader


def _verify(version: int, block: int, values: bytes, signature: bytes) -> bool:
    return signature == b"ok"


def test_the_model_is_assembled_from_every_shards_blocks() -> None:
    # Prepare
    reader = _reader({"shard-0": [_block(1, 3)], "shard-1": [_block(0, 3)]})
    # Execute
    vector, version = reader.pull(LAYOUT, 3, verify=_verify)
    # Assert
    assert version == 3
    assert vector.tolist() == [0, 1, 2, 3, 10, 11, 12]


def test_a_block_without_a_valid_signature_or_at_another_version_is_refused() -> None:
    unsigned = _reader({"shard-0": [_block(1, 3, b"forged")], "shard-1": [_block(0, 3)]})
    with pytest.raises(InvalidArgumentError, match="shard-0 served block 1 without a valid"):
        unsigned.pull(LAYOUT, 3, verify=_verify)
    moving = _reader({"shard-0": [_block(1, 4)], "shard-1": [_block(0, 3)]})
    with pytest.raises(RoundClosedError, match="different versions"):
        moving.pull(LAYOUT, 3, verify=_verify)
