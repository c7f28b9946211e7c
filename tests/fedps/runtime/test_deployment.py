"""Tests for fedps.runtime.deployment's supervision rules: restart backoff, the restart limit,
when a finished run stops, and the progress line of a round."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedps.config import load_config
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.runtime import deployment as deployment_module
from fedps.runtime.deployment import (
    Deployment,
    RestartPolicy,
    local_cluster,
    round_line,
    write_config,
)
from tests.role_processes import wait_listening


def _round(**fields: object) -> RoundSummary:
    values: dict[str, object] = {
        "round": 3,
        "version": 3,
        "contributors": 5,
        "accuracy": 0.9123,
        "loss": 0.3,
        "max_epsilon": 1.8412,
        "bytes_pushed": 1000,
        "seconds": 4.21,
        "abandoned": False,
        "push_seconds": 1.0,
    }
    return RoundSummary(**{**values, **fields})  # type: ignore[arg-type]


def test_restart_delay_doubles_from_the_first_delay() -> None:
    # Prepare
    policy = RestartPolicy(max_restarts=5, window_s=300.0, first_delay_s=1.0, max_delay_s=8.0)
    # Execute
    delays = [policy.delay([100.0] * n, now=100.0) for n in range(5)]
    # Assert: 1, 2, 4, then capped at 8
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_restart_limit_counts_only_the_window() -> None:
    # Prepare
    policy = RestartPolicy(max_restarts=2, window_s=60.0)
    # Execute / Assert: two restarts within the minute: no third
    assert policy.delay([10.0, 20.0], now=30.0) is None
    # ... but once the first is older than the window, one more is allowed
    assert policy.delay([10.0, 20.0], now=75.0) == pytest.approx(2.0)


class _FinishedCoordinator:
    """A coordinator stub whose run is finished, with ``told_done`` of its 3 clients told so
    (more each call, up to ``told_done[-1]``)."""

    def __init__(self, told_done: list[int]) -> None:
        self.told_done = told_done
        self.calls = 0

    def get_status(self, timeout_s: float) -> ClusterStatus:
        del timeout_s
        self.calls += 1
        assert self.calls < 1000, "hang guard: supervise never stopped"
        told = self.told_done[min(self.calls, len(self.told_done)) - 1]
        return ClusterStatus("run", 2, 2, 3, True, (), 1.0, 1e-5, 0, 0.0, told_done=told)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("told_done", [[3], [1, 2, 3]])
def test_a_finished_run_stops_once_every_client_was_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, told_done: list[int]
) -> None:
    # Prepare: a finished run whose clients hear it at once, or one after the other
    config = load_config(None, cluster=local_cluster(tmp_path / "state"))
    coordinator = _FinishedCoordinator(told_done)
    monkeypatch.setattr(deployment_module, "CoordinatorStub", lambda address: coordinator)
    lines: list[str] = []
    # Execute: a linger far beyond any test's time, not waited out
    status = Deployment(tmp_path / "fedps.toml", config).supervise(
        echo=lines.append, poll_s=0.0, linger_s=3600.0
    )
    # Assert: stopped at the poll that saw the last client told
    assert status.told_done == 3 and coordinator.calls == len(told_done)
    assert lines == [
        "training finished after 2 rounds; stopping the cluster once every client has heard "
        "(at most 3600 s)"
    ]


def test_round_line_of_an_applied_round() -> None:
    # Prepare / Execute
    line = round_line(_round(), rounds=10)
    # Assert
    assert line == "round 3/10: 5 clients, accuracy 0.912, epsilon 1.84 (max), 4.2 s"


def test_round_line_of_a_round_not_evaluated_leaves_accuracy_out() -> None:
    # Prepare / Execute
    line = round_line(_round(accuracy=-1.0), rounds=10)
    # Assert
    assert line == "round 3/10: 5 clients, epsilon 1.84 (max), 4.2 s"


def test_round_line_shows_a_task_s_own_metrics() -> None:
    # Prepare: a regression task's round (no accuracy) and a classifier's with one more metric
    regression = _round(accuracy=-1.0, metrics={"loss": 0.2734, "mae": 0.41239})
    classifier = _round(metrics={"loss": 0.3, "accuracy": 0.912, "f1": 0.9})
    # Execute / Assert
    assert round_line(regression, rounds=10) == (
        "round 3/10: 5 clients, loss 0.2734, mae 0.4124, epsilon 1.84 (max), 4.2 s"
    )
    assert round_line(classifier, rounds=10) == (
        "round 3/10: 5 clients, accuracy 0.912, f1 0.9, epsilon 1.84 (max), 4.2 s"
    )


def test_round_line_of_one_client_says_client() -> None:
    # Prepare / Execute
    line = round_line(_round(contributors=1), rounds=10)
    # Assert
    assert line.startswith("round 3/10: 1 client, accuracy")


def test_round_line_of_an_abandoned_round_says_so() -> None:
    # Prepare / Execute
    line = round_line(_round(abandoned=True, contributors=1), rounds=10)
    # Assert
    assert line == "round 3/10: abandoned (no quorum, 1 pushed), 4.2 s"


@pytest.mark.integration
def test_roles_started_from_a_folder_with_the_users_server_py_run_fedps_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a user's project folder whose own modules carry fedps's package names
    project = tmp_path / "project"
    project.mkdir()
    for name in ("server", "crypto", "clients"):
        (project / f"{name}.py").write_text(f'raise SystemExit("the user\'s {name}.py ran")\n')
    monkeypatch.chdir(project)
    config = load_config(None, cluster=local_cluster(tmp_path / "state"), tls={"insecure": True})
    path = tmp_path / "fedps.toml"
    write_config(config, path)
    deployment = Deployment(path, config)
    # Execute: start the key holder from there, as ``fedps up`` does
    try:
        deployment.start("keyholder", "keyholder")
        wait_listening(config.cluster.keyholder, deployment.processes["keyholder"])
    finally:
        deployment.stop()
    # Assert: it served (before: it stopped with "your file ./crypto.py hides ...")
    log = (deployment.log_dir / "keyholder.log").read_text()
    assert "hides" not in log and "the user's" not in log, log
