"""Tests for server.coordinator.cluster_peers: a round is opened and closed on every shard at
once, and the clients complete on every shard holding blocks are the round's."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import cast

import numpy as np

from fedps.config import load_config
from fedps.rpc import keyholder_messages as records
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.shard_messages import ClosedRound, RoundOpening
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import MAX_MESSAGE_BYTES
from fedps.sharding.blocks import BlockLayout
from server.coordinator.cluster_peers import ClusterPeers
from server.shard_misses import ShardMisses
from tests.waiting import HANG_S


class _MeetingShard:
    """A shard that answers only once every shard is being called (``meeting``)."""

    def __init__(self, meeting: threading.Barrier, closed: ClosedRound) -> None:
        self.meeting = meeting
        self.closed = closed
        self.opened: list[RoundOpening] = []

    def open_round(self, opening: RoundOpening, *, timeout_s: float = 0.0) -> None:
        self.meeting.wait()
        self.opened.append(opening)

    def close_round(self, round_: int, *, timeout_s: float = 0.0) -> ClosedRound:
        self.meeting.wait()
        return self.closed


def test_a_round_opens_and_closes_on_every_shard_at_once() -> None:
    # Prepare: three shards that wait for each other (called one by one, none answers); the
    # third owns no block
    config = load_config(None, cluster={"shards": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]})
    peers = ClusterPeers(
        config.cluster, stop=threading.Event(), misses=ShardMisses(limit=3, deadline_s=60.0)
    )
    meeting = threading.Barrier(3, timeout=HANG_S)
    closings = [ClosedRound(("a", "b"), 4), ClosedRound(("b", "c"), 5), ClosedRound((), 0)]
    fakes = [_MeetingShard(meeting, closed) for closed in closings]
    peers._params.shards = cast(
        dict[str, ShardStub], dict(zip(config.cluster.shard_ids, fakes, strict=True))
    )
    opening = records.CommitOpening(7, 3, "run", "ctx", {"a": b"k" * 32})
    # Execute
    peers.open_round(opening, records.CommitSet(("a",), True, ()))
    accepted = peers.close_round(7, frozenset({"a", "b", "c"}))
    # Assert
    assert accepted == {"b"}
    assert all([o.round for o in fake.opened] == [7] for fake in fakes)


class _UploadKeyHolder:
    """A key holder that keeps the messages of the initial model."""

    def __init__(self) -> None:
        self.uploads: list[records.ModelUpload] = []

    def initialize_model(self, uploads: Sequence[records.ModelUpload]) -> records.ModelState:
        self.uploads.extend(uploads)
        return records.ModelState(version=0, num_params=0, initialized=True, last_round=0)


def test_a_model_larger_than_a_message_goes_to_the_key_holder_in_several() -> None:
    # Prepare: 3M parameters (12 MB), more than gRPC's largest message
    config = load_config(None)
    peers = ClusterPeers(
        config.cluster, stop=threading.Event(), misses=ShardMisses(limit=3, deadline_s=60.0)
    )
    keyholder = _UploadKeyHolder()
    peers._keyholder = cast(KeyHolderStub, keyholder)
    layout = BlockLayout(3_000_000, 2048)
    vector = np.arange(layout.num_params, dtype=np.float32)

    # Execute
    peers.initialize(layout, vector, 0, force=False)

    # Assert
    uploads = keyholder.uploads
    assert len(uploads) > 1
    assert all(u.num_params == layout.num_params for u in uploads)
    assert all(u.to_proto().ByteSize() < MAX_MESSAGE_BYTES for u in uploads)
    blocks = {b.block: b.values for u in uploads for b in u.blocks}
    assert sorted(blocks) == list(range(layout.num_blocks))
    joined = layout.join({b: np.frombuffer(v, "<f4") for b, v in blocks.items()})
    np.testing.assert_array_equal(joined, vector)
