"""Tests for a party's own view of a round: the coordinator's set, the shards' blocks."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import cast

import numpy as np
import pytest

from crypto import CiphertextSum, pack_sums
from fedps.errors import PeerUnavailableError, PolicyError
from fedps.rpc.coordinator_messages import ClosedRound
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.messages import Aggregate, Contribution
from fedps.rpc.shard_messages import AggregatePart
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from server.keyholder.cluster_round_source import ClusterRoundSource
from tests.crypto.threshold_keys import Joint, aggregate, generate

COHORT = frozenset({"a", "b", "c"})
BLOCKS = 6


class _Coordinator:
    def __init__(self, ring: RingView | None = None) -> None:
        self.ring = ring or RingView()  # none: the ring the run started on

    def get_closed_round(self, round_: int) -> ClosedRound:
        return ClosedRound(round_, tuple(sorted(COHORT)), **self.ring.fields())


class _Shard:
    """A shard's reply: the blocks it is given (as the test tampers with them)."""

    def __init__(self, blocks: list[Aggregate]) -> None:
        self.blocks = blocks
        self.gone = False

    def fetch_aggregate(
        self, round_: int, contributors: Collection[str]
    ) -> Iterator[AggregatePart]:
        if self.gone:
            raise PeerUnavailableError("the shard is gone")
        yield AggregatePart(blocks=tuple(self.blocks))


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(2)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    one = aggregate(joint.public, len(COHORT), 1)[0]
    return np.repeat(one, BLOCKS, axis=0)


def _source(
    joint: Joint, rows: np.ndarray, moved: RingView | None = None
) -> tuple[ClusterRoundSource, dict[str, _Shard]]:
    """Shards 0 and 1 start the run; ``moved``: the ring the coordinator applies the round on."""
    ring = HashRing(["shard-0", "shard-1"])
    holding = ring if moved is None else moved.ring(ring.virtual_nodes)
    manifest = {c: Contribution(1.0, b"r" * 32) for c in COHORT}
    sums = [CiphertextSum(joint.public, row.copy()) for row in rows]
    packed = pack_sums(sums)
    shards = {sid: _Shard([]) for sid in ("shard-0", "shard-1", "shard-2")}
    for block, data in enumerate(packed):
        shards[holding.owner(block)].blocks.append(Aggregate(block, data, dict(manifest)))
    source = ClusterRoundSource(
        cast(CoordinatorStub, _Coordinator(moved)),
        {sid: cast(ShardStub, shard) for sid, shard in shards.items()},
        ring,
        joint.public,
    )
    return source, shards


def test_the_aggregate_is_every_owners_blocks_in_order(joint: Joint, rows: np.ndarray) -> None:
    # Prepare
    source, _ = _source(joint, rows)
    # Execute
    blocks, got = source.aggregate(1, COHORT)
    # Assert
    assert source.closed_contributors(1) == COHORT
    assert blocks == list(range(BLOCKS))
    assert np.array_equal(got, rows)


@pytest.mark.parametrize(
    "moved", [RingView(1, ("shard-1",)), RingView(1, ("shard-0", "shard-1", "shard-2"))]
)
def test_the_aggregate_comes_from_the_ring_the_round_is_applied_on(
    joint: Joint, rows: np.ndarray, moved: RingView
) -> None:
    # Prepare: the coordinator moved the ring (shard-0 declared gone; shard-2 added): each
    # block is on its new owner, and a shard off the ring does not answer
    source, shards = _source(joint, rows, moved)
    for sid, shard in shards.items():
        shard.gone = sid not in moved.nodes

    # Execute
    contributors = source.closed_contributors(1)
    blocks, got = source.aggregate(1, contributors)

    # Assert
    assert source.view == moved
    assert blocks == list(range(BLOCKS))
    assert np.array_equal(got, rows)


def test_a_ring_naming_an_unknown_shard_is_refused(joint: Joint, rows: np.ndarray) -> None:
    # Prepare
    source, _ = _source(joint, rows)
    cast(_Coordinator, source._coordinator).ring = RingView(1, ("shard-0", "shard-9"))
    # Execute / Assert
    with pytest.raises(PolicyError, match="shard-9"):
        source.closed_contributors(1)
    assert source.view == RingView(0, ("shard-0", "shard-1"))


@pytest.mark.parametrize("fault", ["foreign", "twice", "manifest", "missing"])
def test_a_shard_reply_out_of_line_is_refused(joint: Joint, rows: np.ndarray, fault: str) -> None:
    # Prepare
    source, shards = _source(joint, rows)
    mine, other = shards["shard-0"].blocks, shards["shard-1"].blocks
    first = other[0]
    if fault == "foreign":  # a block another shard owns
        mine.append(first)
        other.remove(first)
    elif fault == "twice":
        other.append(first)
    elif fault == "manifest":  # the sum of a sub-cohort
        other[0] = Aggregate(
            first.block, first.ciphertext, dict(list(first.contributions.items())[:2])
        )
    else:
        other.remove(first)
    # Execute / Assert
    with pytest.raises(PolicyError):
        source.aggregate(1, COHORT)
