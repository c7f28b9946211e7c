"""``fedps experiment`` on the user's own task: a regression model of the wine data, each
client with its own CSV file, swept over epsilon on the real platform; the records carry the
task's metrics."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from sklearn.datasets import load_wine

from fedps.errors import ConfigError
from fedps.experiments.experiment import run_experiment
from fedps.experiments.grid import load_grid
from tests.waiting import HANG_S

_TASK = '''
"""Predict a wine's alcohol from its other measurements."""

import numpy as np
import torch


def model():
    return torch.nn.Linear(12, 1)


def _read(path):
    rows = np.loadtxt(path, delimiter=",", ndmin=2)
    return rows[:, 1:], rows[:, 0]


def load_data(client):
    return _read(client.path)


def load_eval_data():
    return _read("{eval_path}")


def metrics(outputs, targets):
    return {{"mae": float((outputs.reshape(targets.shape) - targets).abs().mean())}}
'''

_GRID = """
[task]
app = "wine_task"
data = "data/client{index}.csv"

[training]
rounds = 1
clients = 2
batch_size = 16
deadline_s = 30.0

[he]
enabled = false

[grid]
epsilon = [4.0]
"""


def _project(root: Path) -> Path:
    """A project folder: the task module, two clients' CSV files, held-out data, the grid."""
    x, _ = load_wine(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)  # column 0, alcohol, is the target
    rows = np.random.default_rng(0).permutation(x)
    (root / "data").mkdir()
    for i, part in enumerate((rows[:60], rows[60:120])):
        np.savetxt(root / "data" / f"client{i}.csv", part, delimiter=",")
    np.savetxt(root / "data" / "eval.csv", rows[120:], delimiter=",")
    (root / "wine_task.py").write_text(_TASK.format(eval_path=root / "data" / "eval.csv"))
    grid = root / "grid.toml"
    grid.write_text(_GRID)
    return grid


def _sweep(grid_path: Path, results: Path) -> list[dict[str, Any]]:
    """Run the grid's sweep on the real platform."""
    return run_experiment(
        grid_path,
        results,
        console=Console(file=io.StringIO()),
        point_timeout_s=HANG_S,  # a hang guard, not a pace
    )


def test_grid_resolves_the_task_and_client_files_beside_it(tmp_path: Path) -> None:
    # Prepare
    grid_path = _project(tmp_path)

    # Execute
    grid = load_grid(grid_path)

    # Assert: the project folder is the grid's; the data pattern is not configuration
    assert grid.base["task"] == {"app": "wine_task", "dir": str(tmp_path.resolve())}
    assert grid.client_data(2) == [
        tmp_path.resolve() / "data" / "client0.csv",
        tmp_path.resolve() / "data" / "client1.csv",
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [('"data/all.csv"', "a path with {index}"), ('"data/{index}-{name}.csv"', "other than")],
)
def test_a_data_pattern_must_name_the_client(tmp_path: Path, data: str, message: str) -> None:
    # Prepare
    grid_path = _project(tmp_path)
    grid_path.write_text(grid_path.read_text().replace('"data/client{index}.csv"', data))

    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        load_grid(grid_path)


def test_own_files_leave_no_partition_axis(tmp_path: Path) -> None:
    # Prepare: each client has its file, and the grid would also re-deal the data
    grid_path = _project(tmp_path)
    text = grid_path.read_text().replace("[grid]\n", '[grid]\npartition = ["iid", "dirichlet"]\n')
    grid_path.write_text(text)

    # Execute / Assert
    with pytest.raises(ConfigError, match="cannot change who holds what"):
        load_grid(grid_path)


@pytest.mark.parametrize(
    ("axis", "expected"),
    [
        ("", {"centralised=true,epsilon=4": [[0, 1]], "centralised=false,epsilon=4": [0, 1]}),
        (
            "clients = [1, 3]\n",
            {
                "centralised=true,clients=1,epsilon=4": [[0, 1, 2]],
                "centralised=false,clients=1,epsilon=4": [0],
                "centralised=false,clients=3,epsilon=4": [0, 1, 2],
            },
        ),
    ],
)
def test_the_centralised_point_pools_every_clients_file(
    tmp_path: Path, axis: str, expected: dict[str, list[int | list[int]]]
) -> None:
    # Prepare: the baseline beside the federated points (of 2 clients, or of 1 and 3)
    grid_path = _project(tmp_path)
    grid_path.write_text(
        grid_path.read_text().replace("[grid]\n", f"[grid]\ncentralised = [true, false]\n{axis}")
    )
    grid = load_grid(grid_path)

    # Execute
    data = {point.key: grid.point_data(point) for point in grid.points()}

    # Assert: a federated point's clients hold a file each; the centralised point's one client
    # holds the files of every client of the largest federated point
    files = grid.client_data(3)
    assert data == {
        key: [[files[i] for i in c] if isinstance(c, list) else files[c] for c in clients]
        for key, clients in expected.items()
    }


@pytest.mark.integration
@pytest.mark.slow  # about a minute: two points of the whole platform
def test_sweep_over_epsilon_trains_the_users_task_on_each_clients_file(tmp_path: Path) -> None:
    # Prepare
    grid_path, results = _project(tmp_path), tmp_path / "results.jsonl"

    # Execute
    records = _sweep(grid_path, results)

    # Assert: the task's metrics of the last round, no accuracy for regression
    assert [r["key"] for r in records] == ["epsilon=4"]
    for record in records:
        assert "error" not in record, record
        assert record["task"] == "wine_task"
        assert record["final_accuracy"] is None
        assert set(record["final_metrics"]) == {"loss", "mae"}
        assert 0 < record["final_metrics"]["mae"] < 5
        assert record["round_metrics"] == [record["final_metrics"]]
    assert 0 < records[0]["max_epsilon"] <= 4.0
    with results.with_suffix(".csv").open() as table:
        rows = list(csv.DictReader(table))
    assert [float(row["final_mae"]) for row in rows] == pytest.approx(
        [r["final_metrics"]["mae"] for r in records]
    )


@pytest.mark.integration
@pytest.mark.slow  # about a minute: one point of the whole platform
def test_the_centralised_baseline_trains_on_every_clients_file(tmp_path: Path) -> None:
    # Prepare: the baseline point alone
    grid_path = _project(tmp_path)
    grid_path.write_text(
        grid_path.read_text().replace("[grid]\n", "[grid]\ncentralised = [true]\n")
    )

    # Execute
    records = _sweep(grid_path, tmp_path / "results.jsonl")

    # Assert: one client, which trained on both files (fedps client --data twice)
    assert [r["key"] for r in records] == ["centralised=true,epsilon=4"]
    assert "error" not in records[0], records[0]
    assert records[0]["clients"] == 1
    assert 0 < records[0]["final_metrics"]["mae"] < 5
