"""Classify wines into three cultivars from 13 chemical measurements.

fedps calls these functions (``[task] app = "wine_task.classify"`` in ``fedps.toml``):
``model()`` on every party, ``load_data(client)`` on each client with the file given to
``fedps client --data``, and ``load_eval_data()`` on the coordinator, which holds
``data/test.csv``. The loss (cross-entropy) and the metric (accuracy) are fedps's defaults for
integer labels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedps.tasks import ClientData

DATA = Path(__file__).resolve().parent.parent / "data"
FEATURES = 13
CLASSES = 3


def model() -> torch.nn.Module:
    """A small MLP (no BatchNorm: Opacus needs per-sample gradients)."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Features standardised with this file's own means and deviations, and the label of the
    last column."""
    table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    x, y = table[:, :-1], table[:, -1]
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-8)
    return x.astype(np.float32), y.astype(np.int64)


def load_data(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    """This client's own rows (``fedps client --data clientK.csv``)."""
    if client.path is None:
        raise ValueError("give each client its file: fedps client --data data/clientK.csv")
    return read_csv(client.path)


def load_eval_data() -> tuple[np.ndarray, np.ndarray]:
    """The operator's held-out rows."""
    return read_csv(DATA / "test.csv")
