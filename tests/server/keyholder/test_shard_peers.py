"""Tests for server.keyholder.shard_peers: a version is published to every shard, each shard
given exactly its blocks, signed; every shard's fetch starts at once."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import cast

import numpy as np
import pytest

from crypto.signing import model_block_digest
from fedps.errors import PeerUnavailableError
from fedps.rpc.shard_messages import AggregatePart, Publication
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from server.keyholder.shard_peers import ShardPeers
from server.shard_misses import ShardMisses

SHARDS = ("shard-0", "shard-1")
LAYOUT = BlockLayout(num_params=78, values_per_block=4)  # 20 blocks, the last one padded


class _Shard:
    """A shard that keeps what is published to it (or is down) and records its fetches."""

    def __init__(self, calls: list[str], sid: str, *, down: bool = False) -> None:
        self.calls = calls
        self.sid = sid
        self.down = down
        self.published: list[Publication] = []

    def publish(self, messages: Sequence[Publication], *, timeout_s: float = 0.0) -> int:
        if self.down:
            raise PeerUnavailableError("restarting")
        self.published += messages
        return sum(len(m.blocks) for m in messages)

    def fetch_aggregate(
        self, round_: int, contributors: Collection[str], *, timeout_s: float = 0.0
    ) -> Iterator[AggregatePart]:
        self.calls.append(self.sid)  # the call starts here, before anything is read
        return iter([AggregatePart()])


def _peers(*, down: str = "") -> tuple[ShardPeers, dict[str, _Shard], list[str]]:
    calls: list[str] = []
    fakes = {sid: _Shard(calls, sid, down=sid == down) for sid in SHARDS}
    misses = ShardMisses(limit=3, deadline_s=60.0)
    return ShardPeers(cast(dict[str, ShardStub], fakes), HashRing(SHARDS), misses), fakes, calls


def test_a_version_reaches_every_shard_each_block_at_its_owner_signed() -> None:
    # Prepare
    peers, fakes, _ = _peers()
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


def test_a_shard_that_does_not_take_a_version_is_raised() -> None:
    peers, _, _ = _peers(down="shard-1")
    with pytest.raises(PeerUnavailableError, match="restarting"):
        peers.publish(np.zeros(78), 5, LAYOUT, sign=lambda digest: b"")


def test_every_shards_fetch_starts_before_any_reply_is_read() -> None:
    # Prepare
    peers, _, calls = _peers()
    # Execute
    replies = peers.fetch_aggregates(3, {"client-0"})
    started = list(calls)
    parts = {sid: list(reply) for sid, reply in replies.items()}
    # Assert
    assert started == list(SHARDS)
    assert parts == {sid: [AggregatePart()] for sid in SHARDS}


def test_a_newer_ring_sends_every_block_to_the_shards_left_and_only_to_them() -> None:
    # Prepare: shard-1 is gone from ring version 1
    peers, fakes, calls = _peers()
    after = RingView(1, ("shard-0",))

    # Execute
    followed = peers.follow(after)
    again = peers.follow(RingView(0, SHARDS))  # an older ring changes nothing
    peers.publish(np.zeros(78), 5, LAYOUT, sign=lambda digest: digest[:8])
    list(peers.fetch_aggregates(1, ["client-0"]))

    # Assert: shard-0 takes all 20 blocks, on ring version 1; shard-1 is asked nothing
    assert followed and not again and peers.view == after
    published = fakes["shard-0"].published
    assert sorted(b.block for m in published for b in m.blocks) == list(range(20))
    assert {(m.ring_version, m.ring_nodes) for m in published} == {(1, ("shard-0",))}
    assert not fakes["shard-1"].published and calls == ["shard-0"]
    assert peers.owner(7) == "shard-0"
