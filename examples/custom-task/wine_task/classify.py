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

from fedps import ClientData
from wine_task.files import HELD_OUT, own_file, read_table, standardised

FEATURES = 13
CLASSES = 3


def model() -> torch.nn.Module:
    """A small MLP (no BatchNorm: Opacus needs per-sample gradients)."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Standardised measurements, and the cultivar of the last column."""
    table = read_table(path)
    return standardised(table[:, :-1]), table[:, -1].astype(np.int64)


def load_data(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    """This client's own rows (``fedps client --data clientK.csv``)."""
    return read_csv(own_file(client))


def load_eval_data() -> tuple[np.ndarray, np.ndarray]:
    """The operator's held-out rows."""
    return read_csv(HELD_OUT)
