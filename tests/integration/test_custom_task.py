"""The custom-task example (examples/custom-task) run as its README says: a project outside
fedps's packages with its own model, and the wine data as one CSV file per client (the
regression task's roles in this process, the classifier's as processes).

``fedps up`` starts the key holder, the shards and the coordinator as processes (mutual TLS,
certificates made on first start), and each client is a ``fedps client --data clientK.csv``
process reading only its own file. The run must reach the accuracy the example promises at the
epsilon it reports, and the reported epsilon must be what every client spent.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clients.edge_client import ClientSummary, EdgeClient
from fedps.config import FedPSConfig, load_config, read_toml
from fedps.runtime.deployment import local_cluster, write_config
from tests.conftest import run_clients, start_cluster, start_coordinator
from tests.role_processes import HANG_S, run_fedps, start_fedps
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom-task"
CLIENTS = 3
ROUNDS = 6


def copy_example(root: Path, *, prepare: bool = True) -> Path:
    """The example project in ``root/project``, with its data files written as its README says
    (``python prepare_data.py``) unless not ``prepare``."""
    project = root / "project"
    shutil.copytree(
        EXAMPLE, project, ignore=shutil.ignore_patterns("data", "state*", "certs", "__pycache__")
    )
    if prepare:
        subprocess.run([sys.executable, "prepare_data.py"], cwd=project, check=True, timeout=HANG_S)
    return project


def local_config(project: Path, name: str) -> tuple[Path, FedPSConfig]:
    """The example's configuration ``name`` on free loopback ports, state and certificates in
    the copy."""
    config = load_config(
        project / name,
        cluster=local_cluster(project / "state"),
        tls={"directory": str(project / "certs")},
        training={"rounds": ROUNDS},  # the example's 20 rounds are more than the checks need
    )
    path = project / f"test-{name}"
    write_config(config, path)
    return path, config


def run_example(project: Path, config_path: Path) -> tuple[str, list[str]]:
    """``fedps up`` plus one ``fedps client --data`` process per client, to the end; their
    outputs."""
    up_log, client_logs = project / "up.log", [project / f"client{k}.log" for k in range(CLIENTS)]
    up = start_fedps("up", str(config_path), log=up_log)
    clients: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(
            lambda: "fedps cluster up" in up_log.read_text() or up.poll() is not None,
            "fedps up",
            hang_s=HANG_S,
            poll_s=0.2,
        )
        for k, log in enumerate(client_logs):
            data = project / "data" / f"client{k}.csv"
            clients.append(
                start_fedps(
                    "client",
                    "-c",
                    str(config_path),
                    "--index",
                    str(k),
                    "--data",
                    str(data),
                    log=log,
                )
            )
        assert up.wait(HANG_S) == 0, up_log.read_text()
        for client, log in zip(clients, client_logs, strict=True):
            assert client.wait(HANG_S) == 0, log.read_text()
    finally:
        for proc in [*clients, up]:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(HANG_S)
    return up_log.read_text(), [log.read_text() for log in client_logs]


def client_epsilons(outputs: list[str]) -> list[float]:
    """The epsilon each client says it spent over the run."""
    found = [re.search(r"done: \d+ rounds, epsilon ([0-9.]+) \(delta", out) for out in outputs]
    assert all(found), outputs
    return [float(m.group(1)) for m in found if m]


def test_wine_classifier_trains_from_per_client_files_with_fedps_up(tmp_path: Path) -> None:
    # Prepare
    project = copy_example(tmp_path)
    path, config = local_config(project, "fedps.toml")
    rounds, budget = config.training.rounds, config.privacy.target_epsilon
    # Execute
    output, client_outputs = run_example(project, path)
    # Assert: one line per round, each applied with every client, and the end said; the last
    # round's accuracy and epsilon
    lines = [line for line in output.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == [
        f"round {r}/{rounds}" for r in range(1, rounds + 1)
    ], output
    assert all(f": {CLIENTS} clients, " in line and "epsilon" in line for line in lines), lines
    assert f"training finished after {rounds} rounds" in output
    last = re.search(
        rf"round {rounds}/{rounds}: {CLIENTS} clients, accuracy ([0-9.]+), epsilon ([0-9.]+)",
        output,
    )
    assert last, output
    accuracy, epsilon = float(last.group(1)), float(last.group(2))
    spent = client_epsilons(client_outputs)
    assert budget is not None and max(spent) <= budget
    assert epsilon == pytest.approx(max(spent), abs=0.005)  # the maximum over the clients
    assert accuracy >= 0.9, output  # three cultivars: chance is about 0.4
    # ... and the model fedps export writes from the stopped cluster's state has that accuracy
    exported = run_fedps("export", "-c", str(path), "-o", str(project / "wine.pt"))
    assert exported.returncode == 0, exported.stderr
    assert exported_accuracy(project, project / "wine.pt") == pytest.approx(accuracy, abs=5e-4)


def _forget_copies(package: str) -> None:
    """Forget modules of ``package`` imported from another test's copy of the example."""
    for cached in [m for m in sys.modules if m.split(".")[0] == package]:
        del sys.modules[cached]


def _import_copy(project: Path, name: str) -> Any:
    """Module ``name`` of the example's copy in ``project``, imported afresh (another test's
    copy may have been imported under the same name)."""
    _forget_copies(name.split(".")[0])
    sys.path.insert(0, str(project))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(project))


def exported_accuracy(project: Path, state_dict: Path) -> float:
    """Accuracy on the operator's held-out file of an exported model, loaded into the task's
    own model with torch.load (no fedps involved)."""
    task = _import_copy(project, "wine_task.classify")
    net = task.model()
    net.load_state_dict(torch.load(state_dict))
    x, y = task.read_csv(project / "data" / "test.csv")
    with torch.no_grad():
        predicted = net(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float(np.mean(predicted == y))


def test_wine_regression_reports_its_own_metric(tmp_path: Path) -> None:
    # Prepare: the example's regression task and client files, its roles in this process
    project = copy_example(tmp_path)
    example = read_toml(project / "regress.toml", "config")
    _forget_copies("wine_task")
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        task={**example["task"], "dir": str(project)},  # type: ignore[dict-item]
        training={**example["training"], "rounds": ROUNDS},  # type: ignore[dict-item]
        privacy=example["privacy"],  # type: ignore[arg-type]
    )
    test_rows = np.loadtxt(project / "data" / "test.csv", delimiter=",", skiprows=1)
    train_rows = np.concatenate(
        [
            np.loadtxt(project / "data" / f"client{k}.csv", delimiter=",", skiprows=1)
            for k in range(CLIENTS)
        ]
    )
    # predicting the training mean: the error a model that learnt nothing would make
    baseline = float(np.abs(test_rows[:, 0] - train_rows[:, 0].mean()).mean())
    try:
        clients = [
            EdgeClient.open(cluster.config, index=k, data=project / "data" / f"client{k}.csv")
            for k in range(CLIENTS)
        ]
        coordinator = start_coordinator(cluster)
        # Execute
        summaries = run_clients(clients)
        history = coordinator.history
    finally:
        cluster.stop()
    # Assert: every round has the task's mean absolute error (and no accuracy), below the
    # baseline's over the last five rounds (one round's DP noise moves it by about 0.05)
    maes = [r.metrics["mae"] for r in history]
    assert len(maes) == ROUNDS and all(r.accuracy < 0 for r in history), history
    assert sum(maes[-5:]) / 5 < 0.85 * baseline, (maes, baseline)
    budget = cluster.config.privacy.target_epsilon or 0.0
    assert all(isinstance(s, ClientSummary) and s.epsilon <= budget for s in summaries)


def test_wine_classifier_trains_from_one_script_and_exports_what_it_reported(
    tmp_path: Path,
) -> None:
    # Prepare: no data files yet (the script writes them itself, with prepare_data's function)
    project = copy_example(tmp_path, prepare=False)
    path, config = local_config(project, "fedps.toml")
    # Execute: the example's script, through the Python API
    done = subprocess.run(
        [sys.executable, "train.py", str(path)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    # Assert: the run's last round, and the exported model loaded into the task's own model
    assert done.returncode == 0, done.stdout + done.stderr
    run = re.search(r"(\d+) rounds: accuracy ([0-9.]+), epsilon ([0-9.]+)", done.stdout)
    exported = re.search(r"exported model: accuracy ([0-9.]+)", done.stdout)
    assert run and exported, done.stdout
    assert int(run.group(1)) == config.training.rounds
    assert float(run.group(2)) >= 0.9
    assert float(exported.group(1)) == float(run.group(2))  # the accuracy the run reported
    assert float(run.group(3)) <= (config.privacy.target_epsilon or 0.0)
