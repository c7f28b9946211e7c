"""Client-level DP around a training that fedps does not run: a user's own ``train``.

A Flower ``ClientApp`` that keeps its own ``train`` function trains the model with its own
data, loss, optimizer and loop; fedps sees only the model it hands over and the one that comes
back. It cannot clip per-sample gradients there (DP-SGD needs its own optimizer and sampler),
so the privacy it adds is client level, DP-FedAvg (McMahan et al. 2018, "Learning
Differentially Private Recurrent Language Models"), exactly as
:class:`clients.dp_trainer.ClientLevelTrainer` applies it: the update ``new - global`` is
clipped to L2 norm ``privacy.clip_norm`` and this client's share of the Gaussian noise is
added, and the accountant counts global rounds at the cohort rate (docs/privacy.md). Only the
local training differs: :class:`WrappedTrainer` calls a :data:`LocalTrain` function, given
for the duration of one round by :meth:`WrappedTrainer.training_with`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from clients.dp_trainer import ClientLevelTrainer
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.errors import ConfigError
from fedps.learning.datasets import Dataset
from fedps.learning.tasks import Task

__all__ = ["LocalTrain", "WrappedTrainer"]

#: Trains a model in place, starting from the global model it is given.
LocalTrain = Callable[[torch.nn.Module], None]

# The trainer's base class sets up a loader over its data; a wrapped training brings its own
# data, so the base gets one placeholder row that is never trained on.
_NO_DATA = Dataset(np.zeros((1, 1), np.float32), np.zeros(1, np.int64), 1, "wrapped-train")


class WrappedTrainer(ClientLevelTrainer):
    """DP-FedAvg around a local training function fedps does not control.

    Parameters
    ----------
    model
        The model the global parameters are loaded into (the task's model: its trainable
        parameters, in ``named_parameters()`` order, are the flat vector fedps aggregates).
    training, privacy
        The run's settings; ``privacy.level`` must be ``"client"``.
    seed
        Used only with ``privacy.insecure_reproducible`` (see
        :class:`clients.dp_trainer.Trainer`); the noise comes from a CSPRNG otherwise.
    task
        The task the model comes from (named in logs and errors).

    Raises
    ------
    ConfigError
        At example level: a wrapped training's per-sample gradients are out of fedps's reach.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        training: TrainingConfig,
        privacy: PrivacyConfig,
        seed: int = 0,
        task: Task | None = None,
    ) -> None:
        if privacy.level != "client":
            raise ConfigError(
                'a wrapped train function needs privacy.level = "client" (the whole update is '
                "clipped and noised): fedps cannot clip the per-sample gradients of a training "
                "it does not run"
            )
        self._local: LocalTrain | None = None
        super().__init__(model, _NO_DATA, training=training, privacy=privacy, seed=seed, task=task)

    @contextmanager
    def training_with(self, local: LocalTrain) -> Iterator[WrappedTrainer]:
        """Train with ``local`` inside the ``with`` block (one round's training)."""
        self._local = local
        try:
            yield self
        finally:
            self._local = None

    def _train_locally(self, only: np.ndarray | None = None) -> None:
        """Run the wrapped training on :attr:`model`, which holds the global parameters."""
        if only is not None:
            raise ConfigError("masked training is fedps's own DP-SGD, not a wrapped one")
        if self._local is None:
            raise RuntimeError("a WrappedTrainer trains only inside training_with(local)")
        self.model.train()
        self._local(self.model)
