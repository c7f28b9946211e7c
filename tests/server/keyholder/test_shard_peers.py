"""Tests for server.keyholder.shard_peers: a version is published to every shard at once,
each shard given exactly its blocks, signed."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest

from crypto.signing import model_block_digest
from fedps.errors import PeerUnavailableError
from fedps.rpc.shard_messages import Publication
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing
from server.keyholder.shard_peers import ShardPeers
from server.shard_misses import ShardMisses
from tests.waiting import HANG_S

SHARDS = ("shard-0", "shard-1")
LAYOUT = BlockLayout(num_params=78, values_per_block=4)  # 20 blocks, the last one padded


class _MeetingShard:
    """A shard that takes a publication only once every shard is being published to."""

    def __init__(self, meeting: threading.Barrier, *, down: bool = False) -> None:
        self.meeting = meeting
        self.down = down
        self.published: list[Publication] = []

    def publish(self, messages: Sequence[Publication], *, timeout_s: float = 0.0) -> int:
        self.meeting.wait()
        if self.down:
            raise PeerUnavailableError("restarting")
        self.published += messages
        return sum(len(m.blocks) for m in messages)


def _peers(*, down: str = "") -> tuple[ShardPeers, dict[str, _MeetingShard]]:
    """Shard peers of fake shards that wait for each other (one by one, none answers)."""
    meeting = threading.Barrier(len(SHARDS), timeout=HANG_S)
    fakes = {sid: _MeetingShard(meeting, down=sid == down) for sid in SHARDS}
    misses = ShardMisses(limit=3, deadline_s=60.0)
    peers = ShardPeers(cast(dict[str, ShardStub], fakes), HashRing(SHARDS), misses)
    return peers, fakes


def test_a_version_reaches_every_shard_at_once_each_block_at_its_owner_signed() -> None:
    # Prepare
    peers, fakes = _peers()
    params = np.arange(78, dtype=np.float64)
    # Execute
    peers.publish(params, 5, LAYOUT, sign=lambda digest: digest[:8])
    # Assert
    for sid, fake in fakes.items():
        owned = [b for b in range(LAYOUT.num_blocks) if peers.owner(b) == sid]
        blocks = [block for message in fake.published for block in message.blocks]
        assert owned and [block.block for block in blocks] == owned
        for block in blocks:
            values = LAYOUT.block_of(params, block.block).astype("<f4").tobytes()
            assert (block.version, block.values) == (5, values)
            assert block.signature == model_block_digest(5, block.block, values)[:8]


def test_a_shard_that_does_not_take_a_version_is_raised_after_the_others_took_it() -> None:
    # Prepare
    peers, fakes = _peers(down="shard-0")
    # Execute / Assert
    with pytest.raises(PeerUnavailableError, match="restarting"):
        peers.publish(np.zeros(78), 5, LAYOUT, sign=lambda digest: b"")
    assert fakes["shard-1"].published and not fakes["shard-0"].published
