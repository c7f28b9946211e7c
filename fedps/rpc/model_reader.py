"""Reading the published model from every shard: what clients and the coordinator share.

Each shard streams the plaintext blocks it owns with their version
(:meth:`fedps.rpc.shard_stub.ShardStub.pull_blocks`); the caller checks that every block
arrived at one version and assembles the flat vector.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import numpy as np

from fedps.errors import InvalidArgumentError, RoundClosedError
from fedps.rpc.fan_out import fan_out
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
        only: Collection[str] | None = None,
    ) -> tuple[np.ndarray, int]:
        """Return ``(flat vector, version)`` of the published model.

        With ``verify(version, block, values, signature)`` (the key holder's signature check,
        :func:`crypto.signing.model_verifier`), every block must verify, so a shard cannot
        serve a model the key holder did not publish. ``only``: the shards on the ring now (None:
        every shard), the others are not asked.

        Raises
        ------
        RoundClosedError
            If a shard has not published ``min_version`` yet, or shards disagree on the
            version (a publish is in flight); retry shortly.
        """
        # Every shard is read at once, one thread each: the pull waits for the slowest shard,
        # not for the sum of them. The first failure in shard order is raised, as one shard
        # after the other would have raised it.
        pulled = fan_out(
            {
                sid: functools.partial(_read, sid, shard, layout, min_version, verify)
                for sid, shard in self.shards.items()
                if only is None or sid in only
            }
        )
        blocks = {b: read for part in pulled.values() for b, read in part.items()}
        versions = {version for part in pulled.values() for version, _ in part.values()}
        if len(versions) > 1:
            raise RoundClosedError(f"shards are at different versions {sorted(versions)}")
        vector = layout.join({b: values for b, (_, values) in blocks.items()})
        return vector, (versions.pop() if versions else 0)


def _read(
    sid: str,
    shard: ShardStub,
    layout: BlockLayout,
    min_version: int,
    verify: Callable[[int, int, bytes, bytes], bool] | None,
) -> dict[int, tuple[int, np.ndarray]]:
    """Shard ``sid``'s blocks of ``min_version`` or later, each checked.

    Returns ``{block: (version, values)}``.

    Raises
    ------
    InvalidArgumentError
        A block of the wrong size, or without a valid signature (with ``verify``).
    """
    blocks: dict[int, tuple[int, np.ndarray]] = {}
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
        blocks[block.block] = (block.version, values.astype(np.float64))
    return blocks
