"""A client's own data (clients/client_setup.py): one file, or several pooled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clients.client_setup import client_partition
from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.learning.tasks import ClientData, Task


class _CsvTask:
    """A task whose clients each hold a CSV file (label first); it notes what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, int, int]] = []
        self.task = Task(name="csv", model=lambda: torch.nn.Linear(2, 2), load_data=self.load)

    def load(self, client: ClientData) -> tuple[Any, Any]:
        assert client.path is not None
        self.told.append((client.path.name, client.index, client.num_clients))
        rows = np.loadtxt(client.path, delimiter=",", ndmin=2)
        return rows[:, 1:], rows[:, 0].astype(np.int64)


def _files(root: Path, *rows: list[list[float]]) -> list[Path]:
    """One CSV file per client with ``rows``."""
    files = [root / f"client{i}.csv" for i in range(len(rows))]
    for path, part in zip(files, rows, strict=True):
        np.savetxt(path, np.array(part), delimiter=",")
    return files


def test_several_files_are_pooled_each_loaded_as_its_client_would(tmp_path: Path) -> None:
    # Prepare: two clients' files
    files = _files(tmp_path, [[0, 1, 2], [1, 3, 4]], [[1, 5, 6]])
    csv, config = _CsvTask(), load_config(None, training={"clients": 1, "min_quorum": 1})

    # Execute
    pooled = client_partition(config, 0, data=files, task=csv.task)

    # Assert: the rows of both, in order; file i loaded as client i of 2
    assert pooled.x.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert pooled.y.tolist() == [0, 1, 1]
    assert csv.told == [("client0.csv", 0, 2), ("client1.csv", 1, 2)]


def test_files_of_different_rows_are_not_pooled(tmp_path: Path) -> None:
    # Prepare: the second client's rows have another number of features
    files = _files(tmp_path, [[0, 1, 2]], [[1, 5, 6, 7]])

    # Execute / Assert
    with pytest.raises(ConfigError, match="cannot pool"):
        client_partition(load_config(None), 0, data=files, task=_CsvTask().task)
