"""What a key-holder party asks the coordinator and the shards itself, never the combiner.

:class:`ClusterRoundSource` is the party's :class:`~.keyholder_party.RoundSource` over the
network: the contributor set a round closed with comes from the coordinator
(``GetClosedRound``), and the aggregate from every shard (``FetchAggregate``, the sums of
exactly that set), each block from the shard the hash ring gives it, once, with a manifest of
exactly that set, unpacked and validated as the key holder unpacks it
(:func:`crypto.unpack_blocks`), so that both compute one digest of one aggregate.

The ring is the one the coordinator applies the round on (it comes with the closed set, and is
followed only forward, :meth:`RingView.newer_than
<fedps.sharding.ring_view.RingView.newer_than>`): after a shard was declared gone or added,
the party asks the shards on the moved ring, each for the blocks it owns now.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping

import numpy as np

from crypto import PublicContext, unpack_blocks
from fedps.errors import PolicyError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView

__all__ = ["ClusterRoundSource"]


class ClusterRoundSource:
    """The coordinator's closed sets and the shards' sums, as one party asks for them.

    Parameters
    ----------
    coordinator
        The coordinator, as the party calls it.
    shards
        Every configured shard, by shard id (on the ring or not).
    ring
        The ring the run starts on (version 0): which shard owns each block until the
        coordinator moves it.
    public
        The joint public context (the sizes and range of every block).
    """

    def __init__(
        self,
        coordinator: CoordinatorStub,
        shards: Mapping[str, ShardStub],
        ring: HashRing,
        public: PublicContext,
    ) -> None:
        self._coordinator = coordinator
        self._shards = dict(shards)
        self._lock = threading.Lock()
        self._ring = ring
        self.view = RingView.configured(ring.nodes)  #: the ring's version and shards now
        self._public = public

    def closed_contributors(self, round_: int) -> frozenset[str]:
        """The clients the coordinator closed ``round_`` with; follows the ring it gives.

        Raises
        ------
        PolicyError
            The ring names a shard that is not configured: nothing is decrypted.
        """
        closed = self._coordinator.get_closed_round(round_)
        view = RingView.of(closed)
        with self._lock:
            if view.newer_than(self.view):
                unknown = set(view.nodes) - set(self._shards)
                if unknown:
                    raise PolicyError(f"round {round_}: ring {view.version} names {unknown}")
                self.view, self._ring = view, view.ring(self._ring.virtual_nodes)
        return frozenset(closed.contributors)

    def aggregate(self, round_: int, contributors: Collection[str]) -> tuple[list[int], np.ndarray]:
        """The sums of ``round_`` over exactly ``contributors`` of every shard on the ring.

        Blocks, and their (B, 2N) rows.

        Raises
        ------
        PolicyError
            A shard sent a block it does not own, a block twice, a manifest of another set, or
            the blocks are not ``0..B-1``: nothing is decrypted.
        """
        wanted = frozenset(contributors)
        with self._lock:
            view, ring = self.view, self._ring
        packed: dict[int, bytes] = {}
        for sid in view.nodes:
            for part in self._shards[sid].fetch_aggregate(round_, wanted):
                for aggregate in part.blocks:
                    block = aggregate.block
                    if ring.owner(block) != sid or block in packed:
                        raise PolicyError(f"round {round_}: {sid} sent block {block} it may not")
                    if frozenset(aggregate.contributions) != wanted:
                        raise PolicyError(
                            f"round {round_}: {sid}'s block {block} sums another contributor set"
                        )
                    packed[block] = aggregate.ciphertext
        blocks = sorted(packed)
        if blocks != list(range(len(blocks))):
            raise PolicyError(f"round {round_}: the shards' blocks are not 0..{len(blocks) - 1}")
        return blocks, unpack_blocks(self._public, [packed[b] for b in blocks])
