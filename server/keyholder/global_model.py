"""The global model the key holder owns: its parameters, version and last applied round.

The server optimizer (:mod:`.server_optimizer`) steps it by each round's released average;
in a mixed policy (:mod:`.group_policy`) the synchronous parameter groups change only when a
round of buffers closes. A snapshot taken before a step puts everything back when the step
cannot be saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedps.errors import InvalidArgumentError
from fedps.sharding.blocks import BlockLayout
from server.keyholder.group_policy import GroupPolicy
from server.keyholder.server_optimizer import ServerOptimizer

__all__ = ["GlobalModel", "ModelSnapshot"]


@dataclass(frozen=True)
class ModelSnapshot:
    """What a step changes, to put back (:meth:`GlobalModel.restore`)."""

    params: np.ndarray | None
    version: int
    last_round: int
    optimizer: dict[str, np.ndarray]
    groups: dict[str, np.ndarray]


class GlobalModel:
    """The model's parameters, version and last applied round, with what steps them.

    The parameters are None until the chief sets them.

    Parameters
    ----------
    optimizer
        The server optimizer.
    groups
        The mixed policy (async mode): values that change only when a round closes.
    """

    def __init__(self, optimizer: ServerOptimizer, groups: GroupPolicy | None = None) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.params: np.ndarray | None = None
        self.version = 0
        self.last_round = 0

    def start(self, vector: np.ndarray, version: int) -> ModelSnapshot:
        """Set the initial model ``vector`` at ``version``, with a fresh optimizer and policy state.

        Returns what was there before (to :meth:`restore` if it cannot be kept).

        Raises
        ------
        InvalidArgumentError
            ``vector`` is empty, not flat or not finite, or does not fit the policy's groups.
        """
        if vector.ndim != 1 or vector.size == 0 or not np.all(np.isfinite(vector)):
            raise InvalidArgumentError("initial model must be a non-empty finite vector")
        if self.groups is not None:
            self.groups.check(vector.size)
            self.groups.reset()
        before = self.snapshot()
        self.params = vector.astype(np.float64)
        self.version = version
        self.optimizer.state.clear()
        return before

    def step(
        self,
        round_: int,
        delta: np.ndarray,
        manifests: Mapping[int, Mapping[str, float]],
        layout: BlockLayout,
    ) -> bool:
        """Apply round ``round_``'s average update ``delta``; the next version.

        ``manifests`` holds each block's contributors with their effective weights. Returns False
        for a buffer that left the synchronous parameter groups as they were.
        """
        assert self.params is not None
        round_closed = True
        if self.groups is None:
            self.params = self.optimizer.step(self.params, delta)
        else:  # the weight behind each value: its block's total
            n = layout.values_per_block
            totals = {b: np.full(n, sum(m.values())) for b, m in manifests.items()}
            self.params, round_closed = self.groups.apply(
                self.optimizer, self.params, delta, layout.join(totals)
            )
        self.version += 1
        self.last_round = round_
        return round_closed

    def snapshot(self) -> ModelSnapshot:
        """What a step or a new start changes."""
        return ModelSnapshot(
            self.params,
            self.version,
            self.last_round,
            dict(self.optimizer.state),
            {k: v.copy() for k, v in self.groups_state().items()},
        )

    def restore(self, snapshot: ModelSnapshot) -> None:
        """Put back what :meth:`snapshot` took."""
        self.params, self.version, self.last_round = (
            snapshot.params,
            snapshot.version,
            snapshot.last_round,
        )
        self.optimizer.state = dict(snapshot.optimizer)
        if self.groups is not None:
            self.groups.load(snapshot.groups)

    def groups_state(self) -> dict[str, np.ndarray]:
        """The mixed policy's state (empty without one)."""
        return self.groups.state() if self.groups is not None else {}
