"""The Python API: a LocalCluster of role processes, clients in threads, the history and the
trained model; and the ``fedps`` logger's default output in a script."""

from __future__ import annotations

import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import fedps
from crypto.tls import OPERATOR_NAME
from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.learning.tasks import evaluate_model, load_task
from fedps.provisioning import provision_cluster
from fedps.runtime.api import use_identity
from tests.role_processes import write_local_config
from tests.waiting import HANG_S


@pytest.mark.integration
@pytest.mark.slow
def test_local_cluster_trains_with_threaded_clients_and_gives_history_and_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a 2-round digits run of 2 clients, without TLS (clients in this process)
    path, config = write_local_config(
        tmp_path,
        training={"rounds": 2, "clients": 2, "min_quorum": 2, "deadline_s": 300.0, "lr": 0.3},
    )
    task = load_task(config)
    exported = tmp_path / "model.pt"

    # Execute
    caplog.set_level(logging.INFO, logger="fedps")
    with fedps.LocalCluster(path) as cluster:
        commands = [p.args for p in cluster.deployment.processes.values()]
        with ThreadPoolExecutor(2) as pool:
            summaries = list(
                pool.map(lambda i: fedps.run_client(path, index=i, timeout_s=HANG_S), range(2))
            )
        finished = cluster.wait_finished(timeout_s=HANG_S)
        history = fedps.read_history(path)
        model = cluster.load_model()
        fedps.export_model(path, exported)
    after = fedps.read_history(path)  # the coordinator is down: from its checkpoint
    warned_first = "finished already" in caplog.text
    # ... and the same state folder again: the finished run is said to be so, not retrained
    with fedps.LocalCluster(path) as cluster:
        replayed = cluster.wait_finished(timeout_s=HANG_S)

    # Assert: every role was a `python -m fedps.cli` process, never this script again
    assert len(commands) == 4  # key holder, 2 shards, coordinator
    # (-P: the script's folder is not on a role's path, so no module of the user's is either)
    assert all(list(c[1:4]) == ["-P", "-m", "fedps.cli"] for c in commands), commands  # type: ignore[index]
    assert sorted(s.client_id for s in summaries) == ["client-0", "client-1"]
    assert all(s.rounds_trained == 2 and s.epsilon > 0 for s in summaries)
    # The history: both rounds, each evaluated with the task's metrics and its privacy spend
    assert finished.finished and history.finished
    assert [r.round for r in history.rounds] == [1, 2]
    assert all({"accuracy", "loss"} <= set(r.metrics) for r in history.rounds)
    assert [r for r, _ in history.metric("accuracy")] == [1, 2]
    assert history.max_epsilon == pytest.approx(max(s.epsilon for s in summaries))
    assert history.rounds[-1].max_epsilon == pytest.approx(history.max_epsilon)
    assert after.rounds == history.rounds and after.finished
    assert replayed.rounds == history.rounds
    assert not warned_first  # the clients finished before wait_finished: no warning then
    assert "finished already (2 rounds): nothing is trained" in caplog.text
    # The model: the task's, scoring what the coordinator reported for the last round
    eval_data = task.eval_data()
    assert eval_data is not None
    metrics = evaluate_model(task, model, eval_data)
    final = history.final_metrics
    assert metrics["accuracy"] == pytest.approx(final["accuracy"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(final["loss"], abs=1e-6)
    again = task.create_model(config.training.seed)
    again.load_state_dict(torch.load(exported))
    assert all(
        torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True)
    )


# A user's script: `import fedps`, maybe its own logging, then the API (which imports the
# training stack; Opacus configures the root logger on import if nothing did before).
_LOG_SCRIPT = """
import logging, sys
import fedps
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING, format="app: %(name)s %(message)s")
from fedps.runtime.api import enable_default_logging
if sys.argv[1] == "bare":
    logging.getLogger().handlers.clear()
enable_default_logging()
enable_default_logging()
logging.getLogger("fedps").info("round 1/2 done")
"""


@pytest.mark.parametrize("setup", ["none", "configured", "bare"])
def test_fedps_info_lines_show_in_a_script_once(setup: str) -> None:
    # Execute: a script that set up no logging, configured its own, or whose root logger has
    # no handler at all
    result = subprocess.run(
        [sys.executable, "-c", _LOG_SCRIPT, setup],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )

    # Assert: the line is printed, exactly once (by the application's handler if it has one)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith("round 1/2 done"), result.stderr
    if setup == "configured":
        assert lines == ["app: fedps round 1/2 done"]
    if setup == "bare":
        assert lines == ["INFO fedps: round 1/2 done"]


def test_the_top_level_exports_the_api() -> None:
    # Execute
    names = {name: getattr(fedps, name) for name in fedps.__all__}

    # Assert
    assert fedps.__all__ == sorted(fedps.__all__)
    assert names["LocalCluster"].__name__ == "LocalCluster"
    assert callable(names["run_client"]) and callable(names["load_model"])
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        fedps.nothing  # noqa: B018


def test_an_in_process_client_under_tls_refuses_the_operators_identity(tmp_path: Path) -> None:
    # Prepare: a mutual-TLS configuration with its certificates; this process speaks as the
    # operator (as a LocalCluster's script does)
    config = load_config(None, tls={"directory": str(tmp_path / "certs")})
    provision_cluster(config)
    use_identity(config, OPERATOR_NAME)

    # Execute / Assert: a client in this process would present the operator's certificate
    with pytest.raises(ConfigError, match="run each client in its own process"):
        fedps.run_client(config, index=0)
