"""Regression on the same files: predict a wine's alcohol content (the first column) from the
other twelve measurements. The loss is mean squared error (fedps's default for real targets);
the metric is the mean absolute error, in % vol."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedps import ClientData
from wine_task.files import HELD_OUT, own_file, read_table, standardised

TYPICAL_ALCOHOL = 13.0  # % vol: the model learns the difference from it


class AlcoholModel(torch.nn.Module):
    """One hidden layer; its output is the difference from a typical alcohol content, so that
    DP-SGD's clipped steps need not carry the model from 0 to 13."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x) + TYPICAL_ALCOHOL
        return out


def model() -> torch.nn.Module:
    """The task's model."""
    return AlcoholModel()


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The twelve other measurements, standardised, and the alcohol content."""
    table = read_table(path)
    return standardised(table[:, 1:-1]), table[:, 0].astype(np.float32)


def load_data(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    """This client's own rows."""
    return read_csv(own_file(client))


def load_eval_data() -> tuple[np.ndarray, np.ndarray]:
    """The operator's held-out rows."""
    return read_csv(HELD_OUT)


def metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Mean absolute error of the predicted alcohol content."""
    return {"mae": float((outputs.reshape(targets.shape) - targets).abs().mean().item())}
