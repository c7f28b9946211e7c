"""Tests for a party's own view of a round: the coordinator's set, the shards' blocks."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import cast

import numpy as np
import pytest

from crypto import CiphertextSum, pack_sums
from fedps.errors import PolicyError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.messages import Aggregate, Contribution
from fedps.rpc.shard_messages import AggregatePart
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.hash_ring import HashRing
from server.keyholder.cluster_round_source import ClusterRoundSource
from tests.crypto.threshold_keys import Joint, aggregate, generate

COHORT = frozenset({"a", "b", "c"})
BLOCKS = 6


class _Coordinator:
    def get_closed_round(self, round_: int) -> frozenset[str]:
        return COHORT


class _Shard:
    """A shard's reply: the blocks it is given (as the test tampers with them)."""

    def __init__(self, blocks: list[Aggregate]) -> None:
        self.blocks = blocks

    def fetch_aggregate(
        self, round_: int, contributors: Collection[str]
    ) -> Iterator[AggregatePart]:
        yield AggregatePart(blocks=tuple(self.blocks))


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(2)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    one = aggregate(joint.public, len(COHORT), 1)[0]
    return np.repeat(one, BLOCKS, axis=0)


def _source(joint: Joint, rows: np.ndarray) -> tuple[ClusterRoundSource, dict[str, _Shard]]:
    ring = HashRing(["shard-0", "shard-1"])
    manifest = {c: Contribution(1.0, b"r" * 32) for c in COHORT}
    sums = [CiphertextSum(joint.public, row.copy()) for row in rows]
    packed = pack_sums(sums)
    shards = {sid: _Shard([]) for sid in ("shard-0", "shard-1")}
    for block, data in enumerate(packed):
        shards[ring.owner(block)].blocks.append(Aggregate(block, data, dict(manifest)))
    source = ClusterRoundSource(
        cast(CoordinatorStub, _Coordinator()),
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
