"""Tests for fedps.sharding.hash_ring: determinism, balance, minimal movement and validation."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedps.errors import ConfigError, InvalidArgumentError
from fedps.sharding.hash_ring import HashRing

_node_names = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True)
_small_vnodes = st.integers(1, 16)


def _shards(count: int) -> list[str]:
    return [f"shard-{i}" for i in range(count)]


def _owners(ring: HashRing, num_blocks: int) -> list[str]:
    return [ring.owner(block) for block in range(num_blocks)]


def test_known_owners_are_stable() -> None:
    # Prepare: these owners pin the hash function and key encoding, which every process and
    # machine must share (Python's salted hash() would change them from run to run).
    ring = HashRing(_shards(4))

    # Execute
    owners = _owners(ring, 8)

    # Assert
    assert owners == [
        "shard-3",
        "shard-2",
        "shard-3",
        "shard-3",
        "shard-3",
        "shard-0",
        "shard-1",
        "shard-2",
    ]


@given(_node_names, _small_vnodes)
def test_owner_ignores_node_order_and_is_repeatable(nodes: list[str], virtual_nodes: int) -> None:
    # Prepare
    ring = HashRing(nodes, virtual_nodes=virtual_nodes)
    reversed_ring = HashRing(nodes[::-1], virtual_nodes=virtual_nodes)

    # Execute
    owners = _owners(ring, 200)

    # Assert
    assert owners == _owners(reversed_ring, 200)
    assert owners == _owners(HashRing(nodes, virtual_nodes=virtual_nodes), 200)
    assert set(owners) <= set(nodes)
    assert ring == reversed_ring
    assert ring.nodes == tuple(sorted(nodes))


@given(_node_names, _small_vnodes, st.integers(0, 300))
def test_assignment_partitions_all_blocks(
    nodes: list[str], virtual_nodes: int, num_blocks: int
) -> None:
    # Prepare
    ring = HashRing(nodes, virtual_nodes=virtual_nodes)

    # Execute
    assignment = ring.assignment(num_blocks)

    # Assert: every node is a key, and every block appears exactly once, at its owner.
    assert list(assignment) == sorted(nodes)
    assert sorted(block for blocks in assignment.values() for block in blocks) == list(
        range(num_blocks)
    )
    for node, blocks in assignment.items():
        assert blocks == sorted(blocks)
        assert all(ring.owner(block) == node for block in blocks)


def test_assignment_lists_nodes_without_blocks() -> None:
    # Prepare
    ring = HashRing(_shards(3))

    # Execute
    assignment = ring.assignment(0)

    # Assert
    assert assignment == {"shard-0": [], "shard-1": [], "shard-2": []}


def test_balance_with_default_virtual_nodes() -> None:
    # Prepare
    ring = HashRing(_shards(4), virtual_nodes=128)
    num_blocks = 10_000
    mean = num_blocks / 4

    # Execute
    sizes = [len(blocks) for blocks in ring.assignment(num_blocks).values()]

    # Assert
    assert sum(sizes) == num_blocks
    assert all(0.6 * mean <= size <= 1.5 * mean for size in sizes), sizes


@pytest.mark.parametrize("shards", range(2, 9))
def test_adding_a_shard_moves_about_its_share_only_to_it(shards: int) -> None:
    # Prepare
    num_blocks = 10_000
    ring = HashRing(_shards(shards))
    new_node = f"shard-{shards}"
    before = _owners(ring, num_blocks)

    # Execute
    after = _owners(ring.add(new_node), num_blocks)

    # Assert
    moved = [block for block in range(num_blocks) if before[block] != after[block]]
    assert all(after[block] == new_node for block in moved)
    fraction = len(moved) / num_blocks
    assert 0.5 / (shards + 1) <= fraction <= 1.6 / (shards + 1), fraction


@pytest.mark.parametrize("shards", range(2, 9))
def test_removing_a_shard_moves_only_its_blocks(shards: int) -> None:
    # Prepare
    num_blocks = 5_000
    ring = HashRing(_shards(shards))
    removed = "shard-1"
    before = _owners(ring, num_blocks)

    # Execute
    after = _owners(ring.remove(removed), num_blocks)

    # Assert
    for block in range(num_blocks):
        if before[block] == removed:
            assert after[block] != removed
        else:
            assert after[block] == before[block]


@settings(max_examples=50)
@given(_node_names, st.text(min_size=1, max_size=12), _small_vnodes)
def test_add_then_remove_moves_blocks_only_to_and_from_new_node(
    nodes: list[str], new_node: str, virtual_nodes: int
) -> None:
    # Prepare
    assume(new_node not in nodes)
    ring = HashRing(nodes, virtual_nodes=virtual_nodes)
    before = _owners(ring, 300)

    # Execute
    grown = ring.add(new_node)
    during = _owners(grown, 300)
    shrunk = grown.remove(new_node)

    # Assert
    assert all(new in (old, new_node) for old, new in zip(before, during, strict=True))
    assert shrunk == ring
    assert _owners(shrunk, 300) == before
    assert ring.nodes == tuple(sorted(nodes))  # the original ring is unchanged


def test_single_node_owns_everything() -> None:
    # Prepare
    ring = HashRing(["only"], virtual_nodes=1)

    # Execute
    assignment = ring.assignment(100)

    # Assert
    assert assignment == {"only": list(range(100))}


@pytest.mark.parametrize(
    ("nodes", "virtual_nodes", "message"),
    [
        ([], 128, "at least one node"),
        (["a", "b", "a"], 128, "unique"),
        (["a", ""], 128, "non-empty strings"),
        (["a", 3], 128, "non-empty strings"),
        ("shard-0", 128, "not a single string"),
        (["a"], 0, "at least 1"),
        (["a"], -5, "at least 1"),
        (["a"], True, "must be an int"),
        (["a"], 2.0, "must be an int"),
    ],
)
def test_invalid_configuration_is_rejected(
    nodes: list[str], virtual_nodes: int, message: str
) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        HashRing(nodes, virtual_nodes=virtual_nodes)


def test_add_and_remove_validate_the_node() -> None:
    # Prepare
    ring = HashRing(["a", "b"])

    # Execute / Assert
    with pytest.raises(ConfigError, match="already on the ring"):
        ring.add("a")
    with pytest.raises(ConfigError, match="non-empty strings"):
        ring.add("")
    with pytest.raises(ConfigError, match="not on the ring"):
        ring.remove("c")
    with pytest.raises(ConfigError, match="at least one node"):
        ring.remove("a").remove("b")


@pytest.mark.parametrize("block", [-1, True, 1.5])
def test_invalid_block_is_rejected(block: int) -> None:
    # Prepare
    ring = HashRing(["a", "b"])

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        ring.owner(block)
    with pytest.raises(InvalidArgumentError):
        ring.assignment(block)
