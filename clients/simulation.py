"""Simulated heterogeneity for experiments: slow devices and clients that die mid-round.

The production client knows nothing of it: whoever builds a client for a simulation (the
``fedps client`` command, the Flower client, tests) wraps its training with
:class:`SimulatedDevice`, a :data:`clients.train_step.TrainMod`, from the configuration's
``training.slow_fraction``, ``training.slow_factor`` and ``training.dropout``.
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np

from clients.train_step import TrainFn, TrainStep
from fedps.config import TrainingConfig

__all__ = ["SimulatedDevice"]

_log = logging.getLogger("fedps")


class SimulatedDevice:
    """The device client ``index`` runs on, as ``training`` simulates it.

    The first ``round(slow_fraction * clients)`` clients train ``slow_factor`` times slower
    (they sleep ``slow_factor - 1`` times their training time after each round). After
    training, each client dies with probability ``dropout``: it stays away until the round
    closes and pushes nothing (the privacy it spent on the round counts all the same). The
    draws come from ``random.Random(seed * 7919 + index)``, one per trained round, so a run
    is reproducible.

    Parameters
    ----------
    training
        The training section (``slow_fraction``, ``slow_factor``, ``dropout``, ``seed``,
        ``clients``, ``deadline_s``).
    index
        The client's data partition.
    """

    def __init__(self, training: TrainingConfig, *, index: int) -> None:
        slow = index < round(training.slow_fraction * training.clients)
        self.slowdown = training.slow_factor if slow else 1.0
        self.dropout = training.dropout
        self.deadline_s = training.deadline_s
        self._dropouts = random.Random(training.seed * 7919 + index)  # simulated mid-round deaths

    def __call__(
        self, step: TrainStep, params: np.ndarray, call_next: TrainFn
    ) -> np.ndarray | None:
        """Train through ``call_next``, slowed down, then perhaps die before pushing."""
        started = time.perf_counter()
        delta = call_next(step, params)
        if delta is None:
            return None
        if self.slowdown > 1:  # simulated slow device
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        if self._dropouts.random() < self.dropout:
            _log.info("%s: dropping out of round %d (simulated)", step.name, step.round)
            gone = min(step.deadline_unix - time.time(), self.deadline_s)
            time.sleep(max(0.0, gone))  # away until the round closes
            return None
        return delta
