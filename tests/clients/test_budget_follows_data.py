"""A client's privacy budget belongs to its data: when the data it is given changes (a file
that grew, other preprocessing), the spend recorded on the earlier data is composed with the
new, never forgotten."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.edge_client import EdgeClient
from crypto.enrolment import issue_tokens
from fedps.config import FedPSConfig, load_config
from fedps.learning.tasks import ClientData, Task
from fedps.provisioning import client_identities


def _rows(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    assert client.path is not None
    table = np.loadtxt(client.path, delimiter=",", ndmin=2)
    return table[:, :-1].astype(np.float32), table[:, -1].astype(np.int64)


TASK = Task(
    name="rows",
    model=lambda: __import__("torch").nn.Linear(4, 2),
    load_data=_rows,
)


def _write(path: Path, rows: int) -> Path:
    rng = np.random.default_rng(rows)
    table = np.column_stack([rng.normal(size=(rows, 4)), rng.integers(0, 2, rows)])
    np.savetxt(path, table, delimiter=",")
    return path


def _config(tmp_path: Path) -> FedPSConfig:
    config = load_config(
        None,
        cluster={"state_dir": str(tmp_path / "state")},
        tls={"insecure": True, "directory": str(tmp_path / "certs")},
        privacy={"target_epsilon": 8.0},
    )
    issue_tokens(config.tls.directory, client_identities(config))
    return config


def _spend_one_round(config: FedPSConfig, data: Path) -> float:
    """A client on ``data`` records one round's spend in its ledger (as before training)."""
    client = EdgeClient.open(config, index=0, data=data, task=TASK)
    try:
        entry = client.state.record(
            client.data_fingerprint,
            client.trainer.spend_after_next_round(),
            privacy=config.privacy,
        )
        return entry.epsilon
    finally:
        client.close()


def test_spend_on_earlier_data_counts_when_the_data_changes(tmp_path: Path) -> None:
    # Prepare: a round spent on a file of 40 rows
    config = _config(tmp_path)
    data = _write(tmp_path / "client0.csv", 40)
    spent = _spend_one_round(config, data)
    # Execute: the file grows by one row (a new fingerprint), and the client restarts
    _write(data, 41)
    client = EdgeClient.open(config, index=0, data=data, task=TASK)
    try:
        restored = client.recorded.epsilon
    finally:
        client.close()
    # Assert: it starts from what was spent, not from zero
    assert spent > 0
    assert restored == pytest.approx(spent, rel=1e-9)


def test_a_client_on_unchanged_data_resumes_its_own_entry(tmp_path: Path) -> None:
    # Prepare
    config = _config(tmp_path)
    data = _write(tmp_path / "client0.csv", 40)
    spent = _spend_one_round(config, data)
    # Execute
    client = EdgeClient.open(config, index=0, data=data, task=TASK)
    try:
        restored = client.recorded.epsilon
    finally:
        client.close()
    # Assert
    assert restored == pytest.approx(spent, rel=1e-9)
