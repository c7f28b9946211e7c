"""A versioned shard ring: which shards are on the hash ring now, as the coordinator publishes it.

The configured shards (``cluster.shards`` but ``cluster.standby``) are the ring's version 0.
When a shard is declared gone, the coordinator removes it (:meth:`RingView.without`,
:meth:`HashRing.remove <fedps.sharding.hash_ring.HashRing.remove>`): the next version holds the
remaining shards, and only the gone shard's blocks move (:func:`moved_blocks`), each to the next
shard along the ring. When the operator adds a shard (:meth:`RingView.with_node`), only the
blocks it takes move, about ``1 / S`` of them, all to it.
Every message that carries a ring carries it as two fields, ``ring_version`` and ``ring_nodes``
(:meth:`RingView.of`, :meth:`RingView.fields`); a message without them (version 0, no ids)
leaves its receiver's ring as it is. A receiver adopts only a newer version
(:meth:`RingView.newer_than`): rings move forward, never back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedps.errors import ConfigError
from fedps.sharding.hash_ring import HashRing

__all__ = ["RingView", "moved_blocks"]


@dataclass(frozen=True)
class RingView:
    """The shards on the ring at one version.

    Parameters
    ----------
    version
        The ring's version: 0 is the configured ring, each change adds one.
    nodes
        The shard ids on the ring, sorted (empty: a message that carries no ring).
    """

    version: int = 0
    nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(sorted(self.nodes)))

    @classmethod
    def configured(cls, shard_ids: Sequence[str]) -> RingView:
        """Version 0: the configured shards."""
        return cls(0, tuple(shard_ids))

    @classmethod
    def of(cls, record: Any) -> RingView:
        """The ring a record carries in its ``ring_version`` and ``ring_nodes`` fields."""
        return cls(int(record.ring_version), tuple(record.ring_nodes))

    def fields(self) -> dict[str, Any]:
        """The record fields that carry this ring (``ring_version``, ``ring_nodes``)."""
        return {"ring_version": self.version, "ring_nodes": self.nodes}

    @property
    def carried(self) -> bool:
        """Whether this is a ring at all (a message without one carries no ids)."""
        return bool(self.nodes)

    def newer_than(self, other: RingView) -> bool:
        """Whether a receiver holding ``other`` adopts this ring: it is one, of a later version."""
        return self.carried and self.version > other.version

    def ring(self, virtual_nodes: int) -> HashRing:
        """The hash ring of these shards with ``virtual_nodes`` points each."""
        return HashRing(self.nodes, virtual_nodes=virtual_nodes)

    def without(self, node: str) -> RingView:
        """The next version, ``node`` removed.

        Raises
        ------
        ConfigError
            ``node`` is not on the ring, or it is the last shard.
        """
        if node not in self.nodes:
            raise ConfigError(f"{node!r} is not on the ring (version {self.version})")
        if len(self.nodes) == 1:
            raise ConfigError(f"cannot remove {node!r}: it is the last shard on the ring")
        return RingView(self.version + 1, tuple(n for n in self.nodes if n != node))

    def with_node(self, node: str) -> RingView:
        """The next version, ``node`` added (about ``1 / S`` of the blocks move to it).

        Raises
        ------
        ConfigError
            ``node`` is already on the ring.
        """
        if node in self.nodes:
            raise ConfigError(f"{node!r} is already on the ring (version {self.version})")
        return RingView(self.version + 1, (*self.nodes, node))


def moved_blocks(old: HashRing, new: HashRing, num_blocks: int) -> dict[int, str]:
    """The blocks of ``0 .. num_blocks - 1`` whose owner differs on ``new``, with the new owner.

    Parameters
    ----------
    old
        The ring before the change.
    new
        The ring after it.
    num_blocks
        The model's number of blocks.

    Returns
    -------
    dict[int, str]
        Each moved block, ascending, mapped to its owner on ``new``.
    """
    moved: dict[int, str] = {}
    for block in range(num_blocks):
        owner = new.owner(block)
        if old.owner(block) != owner:
            moved[block] = owner
    return moved
