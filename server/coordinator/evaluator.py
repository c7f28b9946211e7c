"""Evaluates a published model on held-out data (the coordinator's test split)."""

from __future__ import annotations

import numpy as np
import torch

from fedps.blocks import flatten_model, load_flat
from fedps.config import TrainingConfig
from fedps.datasets import load_dataset
from fedps.models import create_model

__all__ = ["Evaluator"]


class Evaluator:
    """Accuracy and loss of a flat parameter vector on the configured test split."""

    def __init__(self, training: TrainingConfig) -> None:
        train, test = load_dataset(training.dataset, data_dir=training.data_dir)
        self._x = torch.from_numpy(test.x)
        self._y = torch.from_numpy(test.y)
        self.model = create_model(
            training.model,
            num_features=train.num_features,
            num_classes=train.num_classes,
            seed=training.seed,
        )

    def initial_vector(self) -> np.ndarray:
        """The model's deterministic initial parameters."""
        return flatten_model(self.model)

    def evaluate(self, vector: np.ndarray) -> tuple[float, float]:
        """Return ``(accuracy, mean cross-entropy loss)`` of ``vector``."""
        load_flat(self.model, vector)
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self._x)
            loss = torch.nn.functional.cross_entropy(logits, self._y).item()
            accuracy = (logits.argmax(dim=1) == self._y).float().mean().item()
        return float(accuracy), float(loss)
