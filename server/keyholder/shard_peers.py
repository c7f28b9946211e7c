"""The key holder's calls to the shards, in one place.

:class:`ShardPeers` fetches a closed round's aggregates from every shard (each fetch within
``security.shard_deadline_s``, its misses counted by :class:`~server.shard_misses.ShardMisses`:
after ``security.max_shard_misses`` in a row the round is refused with
:class:`~fedps.errors.ShardStalledError`, naming the shard, until it answers), publishes each
new model version to the shards that own its blocks, every block signed, and lends its shard
clients to the tracer (:mod:`.blame`), which asks a shard for evidence after a failed check. It
calls the shards on the ring the coordinator published last (:meth:`ShardPeers.follow`): a
removed shard is asked nothing more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping

import numpy as np

from crypto.signing import model_block_digest
from fedps.errors import FedPSError, InvalidArgumentError, PeerUnavailableError, ShardStalledError
from fedps.rpc.fan_out import fan_out
from fedps.rpc.messages import ParameterBlock
from fedps.rpc.shard_messages import AggregatePart, Publication
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import batched
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from server.shard_misses import ShardMisses

__all__ = ["PUBLISH_S", "ShardPeers"]

#: The deadline of each publication to a shard: a restarting shard fails it, then a retry.
PUBLISH_S = 60.0


class ShardPeers:
    """Every shard, as the key holder calls it.

    Parameters
    ----------
    clients
        A client of every configured shard, by shard id (on the ring or not).
    ring
        The cluster's configured hash ring: which shard owns each block until the coordinator
        publishes another (:meth:`follow`).
    misses
        Counts each shard's fetches that miss their deadline (not persisted).
    """

    def __init__(
        self, clients: Mapping[str, ShardStub], ring: HashRing, misses: ShardMisses
    ) -> None:
        self._all = dict(clients)
        #: the shards on the ring, by shard id (a standby joins when the coordinator adds it)
        self.clients = {sid: c for sid, c in clients.items() if sid in ring.nodes}
        self.ring = ring
        self.view = RingView.configured(ring.nodes)  #: the ring's version and shards
        self.misses = misses
        self._refusals: dict[str, int] = {}  # publications each shard refused in a row

    def follow(self, view: RingView, *, force: bool = False) -> bool:
        """Follow the shard ring ``view`` if it is newer (``force``: whatever its version).

        Returns whether it is followed now.
        """
        if not (force or view.newer_than(self.view)):
            return False
        unknown = set(view.nodes) - set(self._all)
        if unknown:
            raise InvalidArgumentError(f"ring {view.version} names unknown shards {unknown}")
        self.view, self.ring = view, view.ring(self.ring.virtual_nodes)
        self.clients = {sid: self._all[sid] for sid in view.nodes}
        return True

    def owner(self, block: int) -> str:
        """The id of the shard that owns ``block``."""
        return self.ring.owner(block)

    def fetch_aggregates(
        self, round_: int, contributors: Collection[str]
    ) -> dict[str, Iterable[AggregatePart]]:
        """Each shard's sums of ``round_`` for exactly ``contributors``, as they stream in.

        With manifests and signed updates; read them to count the shard's answer. Every shard's
        call starts here, at once: each shard sums while the key holder reads another's reply.
        """
        deadline_s = self.misses.deadline_s
        return {
            sid: self.misses.stream(
                sid,
                "FetchAggregate",
                shard.fetch_aggregate(round_, contributors, timeout_s=deadline_s),
            )
            for sid, shard in self.clients.items()
        }

    def publish(
        self, params: np.ndarray, version: int, layout: BlockLayout, sign: Callable[[bytes], bytes]
    ) -> None:
        """Publish model ``version`` (``params``, cut by ``layout``) to the shards.

        Each block goes to its owner with its signature (``sign`` of its digest). Every shard's
        blocks are signed and sent from a thread of their own, all shards at once
        (:func:`~fedps.rpc.fan_out.fan_out`): one shard installs its blocks while the next
        shard's are signed, and a round's publication waits for the slowest shard, not the sum.

        Raises
        ------
        ShardStalledError
            A shard refused ``security.max_shard_misses`` publications in a row, or held that
            many open past their deadline: named, never asked again forever.
        FedPSError
            A shard did not take it (every shard's call has ended by then).
        """
        per_shard: dict[str, list[int]] = {s: [] for s in self.clients}
        for b in range(layout.num_blocks):
            per_shard[self.owner(b)].append(b)
        fan_out(
            {
                sid: functools.partial(self._publish_to, sid, blocks, params, version, layout, sign)
                for sid, blocks in per_shard.items()
            }
        )

    def _publish_to(
        self,
        sid: str,
        blocks: list[int],
        params: np.ndarray,
        version: int,
        layout: BlockLayout,
        sign: Callable[[bytes], bytes],
    ) -> None:
        """Sign ``blocks`` of model ``version`` and publish them to shard ``sid``."""
        signed = []
        for b in blocks:
            values = layout.block_of(params, b).astype("<f4").tobytes()
            signed.append(
                ParameterBlock(b, version, values, sign(model_block_digest(version, b, values)))
            )
        n = layout.values_per_block
        messages = [
            Publication(version, layout.num_blocks, n, tuple(batch), **self.view.fields())
            for batch in batched(signed, lambda p: len(p.values))
        ] or [Publication(version, layout.num_blocks, n, **self.view.fields())]
        shard = self.clients[sid]
        try:  # a publication held open past its deadline is a miss (ShardMisses)
            self.misses.call(sid, "Publish", lambda: shard.publish(messages, timeout_s=PUBLISH_S))
        except PeerUnavailableError:
            raise
        except FedPSError as exc:  # refused (a stall is a refusal too: raised as it is)
            run = self._refusals[sid] = self._refusals.get(sid, 0) + 1
            if run >= self.misses.limit and not isinstance(exc, ShardStalledError):
                raise ShardStalledError(
                    f"{sid} refused the publication of version {version} {run} times in a row "
                    f"(last: {exc}); every round needs it: restart it or replace it "
                    "(docs/operations.md)"
                ) from exc
            raise
        self._refusals.pop(sid, None)
