"""Evaluation where the data is: a task without the operator's evaluation data is evaluated by
its clients on their own data only with ``task.client_eval`` (outside the DP guarantee), and
the coordinator records the mean over the round's clients, refusing what is not a few finite
numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from clients.edge_client import EdgeClient
from fedps.config import load_config
from fedps.errors import InvalidArgumentError
from fedps.learning.tasks import Task, load_task, register_task, task_names
from tests.conftest import run_clients, start_cluster, start_coordinator

pytestmark = [pytest.mark.integration]

TASK = "digits-without-eval-data"
CLIENTS = 3
TRAINING = {"rounds": 2, "clients": CLIENTS, "min_quorum": CLIENTS, "deadline_s": 300.0}

if TASK not in task_names():  # the built-in digits task, less the operator's test split
    _digits = load_task(load_config(None))
    register_task(TASK, Task(name=TASK, model=_digits.model, load_data=_digits.load_data))


def _train(tmp_path: Path, *, client_eval: bool) -> list[dict[str, float]]:
    """Two rounds of the task; each round's recorded metrics."""
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training=TRAINING,
        task={"app": TASK, "client_eval": client_eval},
    )
    try:
        clients = [EdgeClient.open(cluster.config, index=i) for i in range(CLIENTS)]
        coordinator = start_coordinator(cluster)
        run_clients(clients)
        return [r.metrics for r in coordinator.history]
    finally:
        cluster.stop()


def test_clients_report_their_metrics_only_when_asked(tmp_path: Path) -> None:
    # Execute
    reported = _train(tmp_path / "on", client_eval=True)
    silent = _train(tmp_path / "off", client_eval=False)
    # Assert: with client_eval, each round has the clients' mean loss and accuracy of the model
    # it started from (the first: the initial model, near chance on ten digits)
    assert len(reported) == 2 and all(set(m) == {"accuracy", "loss"} for m in reported)
    assert reported[0]["accuracy"] < 0.3 < reported[1]["accuracy"]
    assert all(math.isfinite(m["loss"]) for m in reported)
    # ... and without it, nothing leaves the clients and no round is evaluated
    assert silent == [{}, {}]


@pytest.mark.parametrize(
    "metrics",
    [
        {"loss": math.nan},
        {"accuracy": math.inf},
        {"": 1.0},
        {"m" * 65: 1.0},
        {f"m{i}": 0.0 for i in range(17)},
    ],
)
def test_the_coordinator_refuses_reported_metrics_that_are_not_a_few_finite_numbers(
    tmp_path: Path, metrics: dict[str, float]
) -> None:
    # Prepare
    cluster = start_cluster(tmp_path, training=TRAINING, task={"app": TASK, "client_eval": True})
    try:
        coordinator = cluster.coordinator
        assert coordinator is not None
        # Execute / Assert: refused before anything else is looked at
        with pytest.raises(InvalidArgumentError, match="metric"):
            coordinator.desk.report(
                "client-0",
                1,
                epsilon=0.0,
                delta=1e-5,
                bytes_pushed=0,
                budget_exhausted=False,
                metrics=metrics,
            )
    finally:
        cluster.stop()
