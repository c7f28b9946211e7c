"""Consistent hashing with virtual nodes: which parameter-server shard owns which block.

Parameter blocks are named by their integer index, shards by string ids such as ``"shard-0"``.
Each shard is placed at ``virtual_nodes`` points of a 64-bit hash ring; a block belongs to the
shard owning the first point at or after the block's own hash, wrapping around. Adding a shard
to ``S`` shards thus moves only about ``1 / (S + 1)`` of the blocks, all to the new shard, and
removing a shard moves only that shard's blocks.

Hashes are the first 8 bytes (big-endian) of BLAKE2b over an ASCII key, so every process on
every machine computes the same assignment from the same shard ids and ``virtual_nodes``:

* point ``i`` of shard ``node``: ``"vnode:{len(node)}:{node}:{i}"`` (UTF-8),
* block ``b``: ``"block:{b}"``.

A :class:`HashRing` is immutable: :meth:`HashRing.add` and :meth:`HashRing.remove` return a new
ring and leave the original unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from collections.abc import Sequence

from fedps.errors import ConfigError, InvalidArgumentError

__all__ = ["HashRing"]

_DIGEST_SIZE = 8


def _hash(key: str) -> int:
    """Return the stable 64-bit hash of ``key``."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=_DIGEST_SIZE).digest()
    return int.from_bytes(digest, "big")


def _block_hash(block: int) -> int:
    return _hash(f"block:{block}")


def _vnode_hash(node: str, index: int) -> int:
    # The length prefix keeps keys of different (node, index) pairs distinct.
    return _hash(f"vnode:{len(node)}:{node}:{index}")


def _check_block(block: int, name: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(block).__name__}")
    if block < 0:
        raise InvalidArgumentError(f"{name} must be non-negative, got {block}")
    return block


class HashRing:
    """An immutable consistent-hash ring mapping block indices to shard ids.

    Parameters
    ----------
    nodes : Sequence[str]
        The shard ids: at least one, each a non-empty string, no duplicates. Their order does
        not matter.
    virtual_nodes : int, default 128
        Points per shard on the ring, at least 1. More points give a more even balance at the
        cost of a larger ring; every process must use the same value.

    Raises
    ------
    ConfigError
        If ``nodes`` is empty, a shard id is not a non-empty string or is repeated, or
        ``virtual_nodes`` is not an int of at least 1.

    Examples
    --------
    >>> ring = HashRing(["shard-0", "shard-1"])
    >>> ring.owner(7) in ring.nodes
    True
    """

    __slots__ = ("_nodes", "_owners", "_points", "_virtual_nodes")

    def __init__(self, nodes: Sequence[str], *, virtual_nodes: int = 128) -> None:
        if isinstance(nodes, str):
            raise ConfigError("nodes must be a sequence of shard ids, not a single string")
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int):
            raise ConfigError(f"virtual_nodes must be an int, got {type(virtual_nodes).__name__}")
        if virtual_nodes < 1:
            raise ConfigError(f"virtual_nodes must be at least 1, got {virtual_nodes}")
        names = tuple(nodes)
        if not names:
            raise ConfigError("a hash ring needs at least one node")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"node names must be non-empty strings, got {name!r}")
        duplicates = sorted(name for name, seen in Counter(names).items() if seen > 1)
        if duplicates:
            raise ConfigError(f"node names must be unique, repeated: {duplicates}")

        # Sorting (point, node) pairs breaks the (unlikely) tie of two equal points by node
        # name, so the ring does not depend on the order of ``nodes``.
        ring = sorted(
            (_vnode_hash(name, index), name) for name in names for index in range(virtual_nodes)
        )
        self._nodes: tuple[str, ...] = tuple(sorted(names))
        self._virtual_nodes = virtual_nodes
        self._points: list[int] = [point for point, _ in ring]
        self._owners: list[str] = [name for _, name in ring]

    @property
    def nodes(self) -> tuple[str, ...]:
        """The shard ids on the ring, sorted."""
        return self._nodes

    @property
    def virtual_nodes(self) -> int:
        """Points per shard on the ring."""
        return self._virtual_nodes

    def __repr__(self) -> str:
        return f"HashRing({list(self._nodes)!r}, virtual_nodes={self._virtual_nodes})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashRing):
            return NotImplemented
        return self._nodes == other._nodes and self._virtual_nodes == other._virtual_nodes

    def __hash__(self) -> int:
        return hash((self._nodes, self._virtual_nodes))

    def owner(self, block: int) -> str:
        """Return the shard id that owns ``block``.

        Parameters
        ----------
        block : int
            Block index, non-negative.

        Returns
        -------
        str
            The owning shard id, one of :attr:`nodes`.

        Raises
        ------
        InvalidArgumentError
            If ``block`` is not a non-negative int.
        """
        _check_block(block, "block")
        index = bisect.bisect_left(self._points, _block_hash(block))
        return self._owners[index % len(self._owners)]

    def assignment(self, num_blocks: int) -> dict[str, list[int]]:
        """Return the blocks ``0 .. num_blocks - 1`` that each shard owns.

        Parameters
        ----------
        num_blocks : int
            Number of blocks, non-negative.

        Returns
        -------
        dict[str, list[int]]
            Every shard id of :attr:`nodes`, in sorted order, mapped to the ascending list of
            the blocks it owns (possibly empty).

        Raises
        ------
        InvalidArgumentError
            If ``num_blocks`` is not a non-negative int.
        """
        _check_block(num_blocks, "num_blocks")
        result: dict[str, list[int]] = {name: [] for name in self._nodes}
        for block in range(num_blocks):
            result[self.owner(block)].append(block)
        return result

    def add(self, node: str) -> HashRing:
        """Return a new ring with shard ``node`` added; this ring is unchanged.

        Parameters
        ----------
        node : str
            The new shard id, not already on the ring.

        Returns
        -------
        HashRing
            A ring with the same ``virtual_nodes`` and ``node`` added.

        Raises
        ------
        ConfigError
            If ``node`` is already on the ring or is not a non-empty string.
        """
        if node in self._nodes:
            raise ConfigError(f"node {node!r} is already on the ring")
        return HashRing([*self._nodes, node], virtual_nodes=self._virtual_nodes)

    def remove(self, node: str) -> HashRing:
        """Return a new ring with shard ``node`` removed; this ring is unchanged.

        Parameters
        ----------
        node : str
            A shard id on the ring.

        Returns
        -------
        HashRing
            A ring with the same ``virtual_nodes`` and without ``node``.

        Raises
        ------
        ConfigError
            If ``node`` is not on the ring, or is its only node.
        """
        if node not in self._nodes:
            raise ConfigError(f"node {node!r} is not on the ring")
        if len(self._nodes) == 1:
            raise ConfigError(f"cannot remove {node!r}: a hash ring needs at least one node")
        return HashRing(
            [name for name in self._nodes if name != node], virtual_nodes=self._virtual_nodes
        )
