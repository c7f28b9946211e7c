"""The key holder's publication of the global model: each version, signed, to its shards.

The key holder publishes the model whenever a shard may lack its current version: the chief's
first model (and a model the key holder keeps, republished in case a shard restarted empty),
and the version each applied round produced. Every block goes to the shard that owns it with
the key holder's signature of its digest (:meth:`.ShardPeers.publish
<.shard_peers.ShardPeers.publish>`); clients and the coordinator check it when they pull. A
shard that does not take the version an applied round produced leaves that round applied and
durable, and unpublished: the coordinator asks again, and asking again publishes it
(:meth:`ModelPublisher.publish_applied`). When the coordinator removes a shard from the ring, the
current version goes to the shards that own its blocks now (:meth:`ModelPublisher.follow_ring`).
"""

from __future__ import annotations

import logging

from crypto.signing import BlockSigner
from fedps.errors import FedPSError, PeerUnavailableError, ShardStalledError
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.ring_view import RingView
from server.keyholder.global_model import GlobalModel
from server.keyholder.shard_peers import ShardPeers

__all__ = ["ModelPublisher"]

_log = logging.getLogger("fedps")


class ModelPublisher:
    """Publishes the global model's current version to the shards, every block signed.

    Parameters
    ----------
    model
        The global model: its parameters and version.
    shards
        Every shard, as the key holder calls it.
    signer
        Signs every published block.
    """

    def __init__(self, model: GlobalModel, shards: ShardPeers, signer: BlockSigner) -> None:
        self._model = model
        self._shards = shards
        self._signer = signer

    def publish(self, layout: BlockLayout) -> None:
        """Publish the current version to the shards, signed, cut into blocks by ``layout``.

        Raises
        ------
        FedPSError
            A shard did not take it.
        """
        assert self._model.params is not None
        self._shards.publish(self._model.params, self._model.version, layout, self._signer.sign)

    def publish_applied(self, round_: int, layout: BlockLayout) -> None:
        """Publish the version round ``round_`` produced, cut into blocks by ``layout``.

        A shard that does not take it leaves the round applied (durably) and unpublished, and the
        caller is asked to retry: the next :meth:`.KeyHolder.apply_round` of the same round
        publishes it again (idempotently).

        Raises
        ------
        PeerUnavailableError
            A shard did not take it (the round stays applied; asking again publishes it).
        ShardStalledError
            A shard refused it, or held it open, ``security.max_shard_misses`` times in a row.
        """
        try:
            self.publish(layout)
        except ShardStalledError:
            raise  # named: the run stops on it (applied; a restart publishes it)
        except FedPSError as exc:
            message = (
                f"round {round_} is applied (version {self._model.version}) but not yet published "
                f"to every shard ({exc}); asking again publishes it"
            )
            _log.warning("%s", message)
            raise PeerUnavailableError(message) from exc

    def follow_ring(self, view: RingView, layout: BlockLayout | None) -> None:
        """Follow the shard ring ``view`` if it is newer, publishing the current version on it.

        ``layout`` cuts the model into blocks (None: no model yet, nothing to publish).

        The new owners of the moved blocks then serve them. A shard that does not take the
        version leaves the ring as it was: asking again follows it and publishes again.

        Raises
        ------
        PeerUnavailableError
            A shard did not take the version (the ring is not followed yet).
        """
        before = self._shards.view
        if not self._shards.follow(view) or layout is None:
            return
        try:
            self.publish(layout)
        except FedPSError as exc:
            self._shards.follow(before, force=True)
            if isinstance(exc, ShardStalledError):
                raise
            raise PeerUnavailableError(
                f"ring version {view.version}: version {self._model.version} is not yet "
                f"published to every shard on it ({exc}); asking again publishes it"
            ) from exc
        _log.info(
            "following ring version %d (%s): version %d published on it",
            view.version,
            ", ".join(view.nodes),
            self._model.version,
        )
