"""Tests for fedps.sharding.ring_view: the versioned ring, the blocks a removal or a join moves."""

from __future__ import annotations

import pytest

from fedps.errors import ConfigError
from fedps.rpc.coordinator_messages import Assignment
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView, moved_blocks

BLOCKS = 4096


def _shards(count: int) -> list[str]:
    return [f"shard-{i}" for i in range(count)]


@pytest.mark.parametrize(
    ("shards", "virtual_nodes"), [(2, 128), (3, 128), (4, 128), (5, 128), (8, 256), (16, 256)]
)
def test_removing_one_of_s_shards_moves_about_blocks_over_s(
    shards: int, virtual_nodes: int
) -> None:
    # Prepare
    ring = HashRing(_shards(shards), virtual_nodes=virtual_nodes)
    owners = {b: ring.owner(b) for b in range(BLOCKS)}

    for gone in ring.nodes:
        # Execute
        moved = moved_blocks(ring, ring.remove(gone), BLOCKS)

        # Assert: exactly the gone shard's blocks move, each to a shard left, and they are
        # within 20% of blocks / S
        assert set(moved) == {b for b, owner in owners.items() if owner == gone}
        assert gone not in moved.values()
        assert abs(len(moved) - BLOCKS / shards) <= 0.2 * BLOCKS / shards, (gone, len(moved))


@pytest.mark.parametrize(
    ("shards", "virtual_nodes"), [(2, 128), (3, 128), (4, 128), (5, 128), (8, 256), (16, 256)]
)
def test_adding_a_shard_to_make_s_moves_about_blocks_over_s_all_to_it(
    shards: int, virtual_nodes: int
) -> None:
    # Prepare: S - 1 shards; the S-th joins
    before = RingView.configured(_shards(shards - 1))
    joined = f"shard-{shards - 1}"

    # Execute
    after = before.with_node(joined)
    moved = moved_blocks(before.ring(virtual_nodes), after.ring(virtual_nodes), BLOCKS)

    # Assert: one version up; only the blocks the new shard takes move, all to it, within 20%
    # of blocks / S
    assert after == RingView(1, tuple(_shards(shards)))
    assert set(moved.values()) == {joined}
    assert set(moved) == set(after.ring(virtual_nodes).assignment(BLOCKS)[joined])
    assert abs(len(moved) - BLOCKS / shards) <= 0.2 * BLOCKS / shards, len(moved)
    with pytest.raises(ConfigError, match="already on the ring"):
        after.with_node(joined)


def test_without_counts_a_version_up_and_keeps_the_last_shard() -> None:
    # Prepare
    view = RingView.configured(["shard-1", "shard-0"])

    # Execute
    after = view.without("shard-1")

    # Assert
    assert view == RingView(0, ("shard-0", "shard-1"))  # sorted, unchanged
    assert after == RingView(1, ("shard-0",))
    assert after.newer_than(view) and not view.newer_than(after)
    with pytest.raises(ConfigError, match="last shard"):
        after.without("shard-0")
    with pytest.raises(ConfigError, match="not on the ring"):
        view.without("shard-9")


def test_a_message_without_a_ring_is_never_newer() -> None:
    # Prepare: a task of a coordinator that sends no ring, and one that does
    plain = Assignment("train", 1)
    moved = Assignment("push", 1, **RingView(2, ("shard-0", "shard-2")).fields())

    # Execute
    views = [RingView.of(Assignment.from_proto(task.to_proto())) for task in (plain, moved)]

    # Assert
    assert not views[0].carried and not views[0].newer_than(RingView())
    assert views[1] == RingView(2, ("shard-0", "shard-2"))
    assert views[1].ring(128).nodes == ("shard-0", "shard-2")
