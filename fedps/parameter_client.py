"""Reading the published model from the shards: what clients and the coordinator share.

Each shard streams the plaintext blocks it owns with their version; the caller checks that
every block arrived at one version and assembles the flat vector.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedps.blocks import BlockLayout
from fedps.errors import InvalidArgumentError, RoundClosedError
from fedps.proto import shard_pb2, shard_pb2_grpc
from fedps.transport import call, create_channel

__all__ = ["ParameterClient"]

#: Deadline of one pull from one shard: a call caught in a restart fails, then is retried.
PULL_TIMEOUT_S = 120.0


class ParameterClient:
    """Pulls the current model from a set of shards.

    Parameters
    ----------
    shards
        ``{shard_id: address}``.
    """

    def __init__(self, shards: dict[str, str]) -> None:
        self._channels = {sid: create_channel(addr) for sid, addr in shards.items()}
        self.stubs = {sid: shard_pb2_grpc.ShardStub(ch) for sid, ch in self._channels.items()}

    def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            channel.close()

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
        request = shard_pb2.PullRequest(min_version=min_version)
        for sid, stub in self.stubs.items():
            replies = call(
                lambda: list(stub.PullBlocks(request, timeout=PULL_TIMEOUT_S)),  # noqa: B023
                f"pull from {sid}",
            )
            for reply in replies:
                for block in reply.blocks:
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
