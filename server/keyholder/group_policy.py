"""Mixed policy: some parameter groups change at every flush, others only when a round closes.

In async mode (FedBuff) the key holder applies every buffer flush at once. With
``[groups] sync`` patterns, the values of the matching parameters wait: each flush adds its
weighted sum for them to a pending total, and every ``buffers_per_round`` applied flushes the
round closes and they move by the weighted average of every update of the round
(``sum_i m_i w_i u_i / sum_i m_i w_i`` over the round's flushes), exactly what one synchronous
round over those updates would give. The other values move at each flush as usual. Only
aggregates are involved: the pending totals are sums of already-decrypted aggregates.
"""

from __future__ import annotations

import numpy as np

from fedps.errors import InvalidArgumentError
from server.keyholder.server_optimizer import ServerOptimizer

__all__ = ["GroupPolicy"]


class GroupPolicy:
    """Holds the synchronous groups' pending update between flushes.

    Parameters
    ----------
    sync_mask
        Boolean vector over the flat model: True where the value is synchronous.
    buffers_per_round
        Applied flushes after which the synchronous values change.
    """

    def __init__(self, sync_mask: np.ndarray, buffers_per_round: int) -> None:
        if sync_mask.dtype != np.bool_ or sync_mask.ndim != 1:
            raise InvalidArgumentError("sync_mask must be a boolean vector")
        if buffers_per_round < 1:
            raise InvalidArgumentError("buffers_per_round must be at least 1")
        self.sync_mask = sync_mask
        self.buffers_per_round = buffers_per_round
        self._index = np.flatnonzero(sync_mask)
        self.pending_sum = np.zeros(self._index.size)
        self.pending_weight = np.zeros(self._index.size)
        self.flushes = 0  # applied flushes since the last round close

    def check(self, num_params: int) -> None:
        """Refuse a model whose size does not match the mask."""
        if num_params != self.sync_mask.size:
            raise InvalidArgumentError(
                f"the model has {num_params} parameters, the group policy was built for "
                f"{self.sync_mask.size}"
            )

    def apply(
        self,
        optimizer: ServerOptimizer,
        params: np.ndarray,
        delta: np.ndarray,
        weights: np.ndarray,
    ) -> tuple[np.ndarray, bool]:
        """Apply one flush; returns the next parameters and whether the round closed.

        ``delta`` is the flush's weighted average update, ``weights`` the total weight behind
        each value (per block, since a block is averaged over its own manifest).
        """
        self.check(params.size)
        idx = self._index
        self.pending_sum += delta[idx] * weights[idx]
        self.pending_weight += weights[idx]
        self.flushes += 1
        if self.flushes < self.buffers_per_round:
            return optimizer.step(params, delta, where=~self.sync_mask), False
        full = delta.copy()
        full[idx] = self.pending_sum / np.maximum(self.pending_weight, np.finfo(float).tiny)
        self.reset()
        return optimizer.step(params, full), True

    def reset(self) -> None:
        """Forget the pending update (a new model, or a round that closed)."""
        self.pending_sum[:] = 0.0
        self.pending_weight[:] = 0.0
        self.flushes = 0

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint must keep."""
        return {
            "pending_sum": self.pending_sum,
            "pending_weight": self.pending_weight,
            "flushes": np.array([self.flushes]),
        }

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state` (absent keys: nothing pending)."""
        if "pending_sum" not in state:
            return
        if state["pending_sum"].shape != self.pending_sum.shape:
            raise InvalidArgumentError("saved pending update does not match the group policy")
        self.pending_sum = state["pending_sum"].astype(np.float64)
        self.pending_weight = state["pending_weight"].astype(np.float64)
        self.flushes = int(state["flushes"][0])
