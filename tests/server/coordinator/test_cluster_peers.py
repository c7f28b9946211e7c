"""Tests for server.coordinator.cluster_peers: a round is opened and closed on every shard at
once, and the clients complete on every shard holding blocks are the round's."""

from __future__ import annotations

import threading
from typing import cast

from fedps.config import load_config
from fedps.rpc import keyholder_messages as records
from fedps.rpc.shard_messages import ClosedRound, RoundOpening
from fedps.rpc.shard_stub import ShardStub
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
