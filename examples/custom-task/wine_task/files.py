"""The example's CSV files: one per client (``data/clientK.csv``) and the operator's
held-out ``data/test.csv``, each with a header row, 13 measurements and the cultivar."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedps import ClientData

DATA = Path(__file__).resolve().parent.parent / "data"
HELD_OUT = DATA / "test.csv"


def read_table(path: Path) -> np.ndarray:
    """The file's rows (the header skipped)."""
    return np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def standardised(x: np.ndarray) -> np.ndarray:
    """Columns scaled with the file's own means and deviations (nothing shared between
    clients), as float32."""
    return ((x - x.mean(axis=0)) / (x.std(axis=0) + 1e-8)).astype(np.float32)


def own_file(client: ClientData) -> Path:
    """The file given to this client (``fedps client --data clientK.csv``)."""
    if client.path is None:
        raise ValueError("give each client its file: fedps client --data data/clientK.csv")
    return client.path
