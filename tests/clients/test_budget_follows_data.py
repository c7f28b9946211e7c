"""A client's privacy budget belongs to its data: when the data it is given changes (a file
that grew, other preprocessing), the largest spend recorded on data that shares rows with it
counts, never forgotten; data that shares no row starts from zero."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from clients.dp_trainer import DPTrainer, History
from clients.edge_client import EdgeClient
from crypto.enrolment import issue_tokens
from fedps.config import FedPSConfig, load_config
from fedps.learning.accounting import epsilon_of_history
from fedps.learning.tasks import ClientData, Task
from fedps.provisioning import client_identities
from fedps.sharding.blocks import flatten_model


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
    """The first ``rows`` rows of one table (a file that grows keeps its earlier rows)."""
    rng = np.random.default_rng(0)
    table = np.column_stack([rng.normal(size=(100, 4)), rng.integers(0, 2, 100)])
    np.savetxt(path, table[:rows], delimiter=",")
    return path


def _config(tmp_path: Path, **privacy: object) -> FedPSConfig:
    config = load_config(
        None,
        cluster={"state_dir": str(tmp_path / "state")},
        tls={"insecure": True, "directory": str(tmp_path / "certs")},
        privacy={"target_epsilon": 8.0, **privacy},
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


# ---------------------------------------------------------------- A, then B, then A again
def _digits_file(path: Path, rows: np.ndarray) -> Path:
    """Digits rows ``rows`` (features scaled to [0, 1], then the label) as a CSV file."""
    digits = load_digits()
    table = np.column_stack([digits.data[rows] / 16.0, digits.target[rows]])
    np.savetxt(path, table, delimiter=",")
    return path


DIGITS = Task(
    name="digits-rows",
    model=lambda: __import__("torch").nn.Linear(64, 10),
    load_data=_rows,
)


def _train_rounds(config: FedPSConfig, data: Path, rounds: int) -> tuple[float, History]:
    """A client on ``data`` trains ``rounds`` real DP-SGD rounds, each recorded before it
    trains; returns the epsilon its ledger holds and the steps the rounds took."""
    client = EdgeClient.open(config, index=0, data=data, task=DIGITS)
    try:
        trainer = client.trainer
        assert isinstance(trainer, DPTrainer)
        params = flatten_model(trainer.model)
        for _ in range(rounds):
            client.ledger.record_next_round()
            params = params + trainer.train_round(params)
        steps = (trainer.noise_multiplier, trainer.sample_rate, rounds * trainer.steps_per_round)
        return client.recorded.epsilon, (steps,)
    finally:
        client.close()


@pytest.mark.privacy
def test_going_back_to_earlier_data_resumes_what_the_data_in_between_spent(
    tmp_path: Path,
) -> None:
    # Prepare: data A (60 digits rows), and B: A's rows reordered, with 20 rows more
    config = _config(tmp_path, noise_multiplier=1.0, target_epsilon=None)
    a_rows = np.arange(60)
    b_rows = np.concatenate([np.random.default_rng(1).permutation(a_rows), np.arange(60, 80)])
    a = _digits_file(tmp_path / "a.csv", a_rows)
    b = _digits_file(tmp_path / "b.csv", b_rows)

    # Execute: two rounds on A, two on B (which holds A's rows), two on A again
    _, on_a = _train_rounds(config, a, 2)
    _, on_b = _train_rounds(config, b, 2)
    reported, again = _train_rounds(config, a, 2)

    # Assert: what the ledger reports covers every step taken on A's rows
    taken = on_a + on_b + again
    recomputed = epsilon_of_history(taken, config.privacy.delta, config.privacy.accountant)
    print(f"A -> B -> A: ledger {reported:.3f}, steps on A's rows {recomputed:.3f} ({taken})")
    assert reported >= recomputed * 0.99
