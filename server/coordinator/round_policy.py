"""Round policies: when a round's commit phase ends and how many updates it needs.

The coordinator runs every round the same way (commit, freeze, push, close, apply; see
:mod:`server.coordinator.coordinator`); a policy answers the three questions on which
synchronous rounds and asynchronous buffers differ:

- :class:`SyncRounds` (``training.mode = "sync"``, FedAvg): the commit phase ends when every
  cohort member has committed or said it has nothing to send, or at ``deadline_s``; a round
  needs ``min_quorum`` updates.
- :class:`AsyncBuffers` (``training.mode = "async"``, FedBuff, Nguyen et al. 2022): a buffer's
  commit phase has no deadline and ends once ``buffer_size`` (K) updates are committed; a
  flush needs ``max(min_quorum, buffer_size)`` updates.

Policies are created by name from a registry, as Opacus creates accountants:
``create_round_policy("sync", training)``; :func:`register_round_policy` adds one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Set

from fedps._registry import add_entry
from fedps.config import TrainingConfig
from fedps.errors import ConfigError

__all__ = [
    "AsyncBuffers",
    "RoundPolicy",
    "SyncRounds",
    "create_round_policy",
    "register_round_policy",
]


class RoundPolicy(ABC):
    """What distinguishes one way of running rounds from another.

    Parameters
    ----------
    training
        The run's training settings.
    """

    def __init__(self, training: TrainingConfig) -> None:
        self.training = training

    @property
    @abstractmethod
    def min_quorum(self) -> int:
        """The fewest complete updates a round may be applied with."""

    @abstractmethod
    def commit_deadline(self, opened_at: float) -> float:
        """When the commit phase of a round opened at ``opened_at`` ends at the latest.

        In Unix seconds; ``math.inf``: no deadline.
        """

    @abstractmethod
    def commitments_complete(
        self, cohort: Set[str], committed: Set[str], reported: Set[str]
    ) -> bool:
        """Whether the commit phase may end before its deadline.

        ``committed`` clients of ``cohort`` committed so far, ``reported`` said they are done (with
        nothing to send).
        """


class SyncRounds(RoundPolicy):
    """Synchronous rounds: the whole cohort, or whoever committed by the deadline."""

    @property
    def min_quorum(self) -> int:
        """``training.min_quorum``."""
        return self.training.min_quorum

    def commit_deadline(self, opened_at: float) -> float:
        """``deadline_s`` after the round opened."""
        return opened_at + self.training.deadline_s

    def commitments_complete(
        self, cohort: Set[str], committed: Set[str], reported: Set[str]
    ) -> bool:
        """Every cohort member committed or reported."""
        return cohort <= committed | reported


class AsyncBuffers(RoundPolicy):
    """Asynchronous buffers: a flush once ``buffer_size`` updates are committed."""

    @property
    def min_quorum(self) -> int:
        """``max(training.min_quorum, training.buffer_size)``."""
        return max(self.training.min_quorum, self.training.buffer_size)

    def commit_deadline(self, opened_at: float) -> float:
        """None (``math.inf``): a buffer waits for its K commitments."""
        return math.inf

    def commitments_complete(
        self, cohort: Set[str], committed: Set[str], reported: Set[str]
    ) -> bool:
        """``buffer_size`` clients committed."""
        return len(committed) >= self.training.buffer_size


_REGISTRY: dict[str, type[RoundPolicy]] = {"async": AsyncBuffers, "sync": SyncRounds}


def register_round_policy(name: str, policy: type[RoundPolicy]) -> None:
    """Make ``policy`` available to :func:`create_round_policy` as ``name``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_REGISTRY, name, policy, "round policy")


def create_round_policy(name: str, training: TrainingConfig) -> RoundPolicy:
    """The round policy ``name`` (``"sync"``, ``"async"`` or a registered one).

    Raises
    ------
    ConfigError
        If ``name`` is not registered.
    """
    try:
        policy = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown round policy {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    return policy(training)
