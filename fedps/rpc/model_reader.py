"""Reading the published model from every shard: what clients and the coordinator share.

Each shard streams the plaintext blocks it owns with their version
(:meth:`fedps.rpc.shard_stub.ShardStub.pull_blocks`); the caller checks that every block
arrived at one version and assembles the flat vector.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedps.errors import InvalidArgumentError, RoundClosedError
from fedps.rpc.shard_stub import PULL_S, ShardStub
from fedps.sharding.blocks import BlockLayout

__all__ = ["ModelReader"]


class ModelReader:
    """Pulls the current model from a set of shards.

    Parameters
    ----------
    shards
        ``{shard_id: address}``.
    """

    def __init__(self, shards: dict[str, str]) -> None:
        #: one typed client per shard, by shard id
        self.shards = {sid: ShardStub(sid, addr) for sid, addr in shards.items()}

    def close(self) -> None:
        """Close every channel."""
        for client in self.shards.values():
            client.close()

    def pull(
        self,
        layout: BlockLayout,
        min_version: int = 0,
        *,
        verify: Callable[[int, int, bytes, bytes], bool] | None = None,
    ) -> tuple[np.ndarray, int]:
        """Return ``(flat vector, version)`` of the published model.

        With ``verify(version, block, values, signature)`` (the key holder's signature check,
        :func:`crypto.signing.model_verifier`), every block must verify, so a shard cannot
        serve a model the key holder did not publish.

        Raises
        ------
        RoundClosedError
            If a shard has not published ``min_version`` yet, or shards disagree on the
            version (a publish is in flight); retry shortly.
        """
        blocks: dict[int, np.ndarray] = {}
        versions: set[int] = set()
        for sid, shard in self.shards.items():
            for block in shard.pull_blocks(min_version, timeout_s=PULL_S):
                values = np.frombuffer(block.values, dtype="<f4")
                if values.size != layout.values_per_block:
                    raise InvalidArgumentError(f"{sid} sent block {block.block} of bad size")
                if verify is not None and not verify(
                    block.version, block.block, block.values, block.signature
                ):
                    raise InvalidArgumentError(
                        f"{sid} served block {block.block} without a valid key-holder signature"
                    )
                blocks[block.block] = values.astype(np.float64)
                versions.add(block.version)
        if len(versions) > 1:
            raise RoundClosedError(f"shards are at different versions {sorted(versions)}")
        return layout.join(blocks), (versions.pop() if versions else 0)
