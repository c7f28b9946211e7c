"""Tests for server.coordinator.coordinator's privacy bookkeeping: the epsilon a client says it
spent arrives at registration, with every GetTask and with every report, and never goes down;
and for its wait for a round's clients."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from crypto.signing import BlockSigner
from fedps.config import load_config
from fedps.errors import ConfigError, InvalidArgumentError
from fedps.learning.tasks import ClientData
from fedps.learning.tasks import Task as UserTask
from fedps.rpc.keyholder_messages import AppliedRound, RoundApplication
from server.coordinator.checkpoint_store import CHECKPOINT_FILE, CheckpointStore
from server.coordinator.cluster_peers import ClusterPeers
from server.coordinator.coordinator import Coordinator
from server.coordinator.privacy_ledger import Declaration
from server.coordinator.round_record import OpenRound, RoundRecord
from server.serve import open_coordinator

DELTA = 1e-5


@pytest.fixture
def coordinator(tmp_path: Path) -> Coordinator:
    """A coordinator whose peers are never called (the client-facing handlers only)."""
    config = load_config(None, cluster={"state_dir": str(tmp_path)})
    return open_coordinator(config, tmp_path / "coordinator")


def _register(
    coordinator: Coordinator, epsilon: float = 0.0, delta: float = DELTA, *, index: int = 0
) -> bytes:
    """Register ``client-{index}`` (as mutual TLS proves it); returns its credential."""
    _, credential = coordinator.registry.register(
        f"edge-{index}",
        100,
        coordinator.layout.num_params,
        BlockSigner().public_key,
        identity=f"client-{index}",
        epsilon=epsilon,
        delta=delta,
    )
    return credential


def _report(
    coordinator: Coordinator,
    credential: bytes,
    *,
    epsilon: float = 2.0,
    noise_multiplier: float | None = None,
) -> None:
    """``client-0`` reports round 1 (nothing pushed)."""
    coordinator.desk.report(
        "client-0",
        1,
        epsilon=epsilon,
        delta=DELTA,
        bytes_pushed=0,
        budget_exhausted=False,
        credential=credential,
        noise_multiplier=noise_multiplier,
    )


def test_epsilon_from_registration_and_get_task_never_goes_down(coordinator: Coordinator) -> None:
    # Prepare: a restarted client registers with what its ledger says it spent
    credential = _register(coordinator, epsilon=1.5)
    seen = [coordinator.client_epsilons["client-0"]]

    # Execute: it records a round (GetTask), reports, then a process that lost its spend
    # (an older client, or one whose GetTask raced) says less
    coordinator.desk.get_task("client-0", credential, epsilon=2.0, delta=DELTA)
    seen.append(coordinator.client_epsilons["client-0"])
    _report(coordinator, credential, epsilon=2.0)
    coordinator.desk.get_task("client-0", credential, epsilon=0.5, delta=DELTA)
    seen.append(coordinator.client_epsilons["client-0"])
    credential = _register(coordinator, epsilon=0.0)
    coordinator.desk.get_task("client-0", credential)  # a caller that sends no spend
    seen.append(coordinator.client_epsilons["client-0"])

    # Assert
    assert seen == [1.5, 2.0, 2.0, 2.0]
    assert coordinator.max_epsilon == (2.0, DELTA)


@pytest.mark.parametrize(
    ("epsilon", "delta"), [(math.nan, DELTA), (-0.1, DELTA), (1.0, 1.0), (1.0, -1e-9)]
)
def test_a_spend_out_of_range_is_refused(
    coordinator: Coordinator, epsilon: float, delta: float
) -> None:
    # Prepare
    credential = _register(coordinator, epsilon=1.0)

    # Execute / Assert: refused on every path, and nothing recorded
    with pytest.raises(InvalidArgumentError, match="epsilon"):
        coordinator.desk.get_task("client-0", credential, epsilon=epsilon, delta=delta)
    with pytest.raises(InvalidArgumentError, match="epsilon"):
        _register(coordinator, epsilon, delta)
    assert coordinator.client_epsilons == {"client-0": 1.0}


def test_no_dp_is_an_infinite_epsilon_not_an_error(coordinator: Coordinator) -> None:
    # Prepare
    credential = _register(coordinator)

    # Execute
    coordinator.desk.get_task("client-0", credential, epsilon=math.inf, delta=DELTA)

    # Assert
    assert coordinator.client_epsilons["client-0"] == math.inf


def test_the_noise_multiplier_travels_in_the_report(coordinator: Coordinator) -> None:
    # Prepare
    credential = _register(coordinator)
    before = coordinator.client_noise_multipliers

    # Execute: a report with the client's noise multiplier, then one that does not say it
    _report(coordinator, credential, noise_multiplier=1.25)
    _report(coordinator, credential)

    # Assert
    assert before == {}
    assert coordinator.client_noise_multipliers == {"client-0": 1.25}


@pytest.mark.parametrize("noise_multiplier", [math.nan, -0.5])
def test_a_noise_multiplier_out_of_range_is_refused(
    coordinator: Coordinator, noise_multiplier: float
) -> None:
    # Prepare
    credential = _register(coordinator)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="noise_multiplier"):
        _report(coordinator, credential, noise_multiplier=noise_multiplier)
    assert coordinator.client_noise_multipliers == {}


def _normed_task() -> UserTask:
    """A task whose model has a BatchNorm layer (Opacus cannot train it per sample)."""

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10)
        )

    def load_data(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((4, 64), np.float32), np.zeros(4, np.int64)

    return UserTask(name="normed", model=model, load_data=load_data)


def test_a_model_dp_sgd_cannot_train_stops_the_coordinator_at_start(tmp_path: Path) -> None:
    # Prepare: example-level DP (the default), a BatchNorm model
    config = load_config(None, cluster={"state_dir": str(tmp_path)})

    # Execute / Assert: refused with the layer and the fix, before any client is waited for
    with pytest.raises(ConfigError, match=r"layer '1' \(BatchNorm1d\).*ModuleValidator\.fix"):
        open_coordinator(config, tmp_path / "coordinator", task=_normed_task())


def test_client_level_dp_takes_a_batchnorm_model(tmp_path: Path) -> None:
    # Prepare: client-level DP clips whole updates, so per-sample gradients are not needed
    config = load_config(None, cluster={"state_dir": str(tmp_path)}, privacy={"level": "client"})

    # Execute
    coordinator = open_coordinator(config, tmp_path / "coordinator", task=_normed_task())

    # Assert
    assert coordinator.layout.num_params > 0


def test_a_client_away_past_one_grace_is_not_waited_for_in_every_round(tmp_path: Path) -> None:
    # Prepare: 3 clients provisioned, 2 of them registered; the first draw waits its grace
    # (short here) for the third, then goes on with the two
    config = load_config(
        None,
        cluster={"state_dir": str(tmp_path)},
        training={"clients": 3, "min_quorum": 2, "deadline_s": 0.05},
    )
    coordinator = open_coordinator(config, tmp_path / "coordinator")
    for index in range(2):
        _register(coordinator, index=index)
    first = coordinator._wait_for_cohort()
    # ... and the next rounds' grace would outlast the test: only a hang guard stops it
    coordinator._training = coordinator._training.model_copy(update={"deadline_s": 3600.0})
    guard = threading.Timer(60.0, coordinator.stop)
    guard.start()

    # Execute: the next draw, the third client still away
    try:
        second = coordinator._wait_for_cohort()
    finally:
        guard.cancel()

    # Assert: the two live clients are drawn at once (None: the guard stopped a wait)
    assert first == second == frozenset({"client-0", "client-1"})


@pytest.mark.privacy
def test_the_privacy_ledger_outlives_the_run_unless_a_new_one_is_started_between_runs(
    tmp_path: Path,
) -> None:
    # Prepare: a coordinator recorded a round of client-0; its run is in progress
    config = load_config(None, cluster={"state_dir": str(tmp_path)})
    state_dir = tmp_path / "coordinator"
    first = open_coordinator(config, state_dir)
    ledger = first.registry.ledger
    assert ledger is not None
    declared = {"client-0": Declaration("data", 1.0, 0.1, 10)}
    ledger.record_round(first.run_id, 1, contributors=declared, members=declared)
    ledger.close()
    spent = first.client_epsilons["client-0"]
    state = {"run_id": first.run_id, "round": 1, "version": 1, "history": [], "clients": {}}
    CheckpointStore(state_dir).save(first.evaluator.initial_vector(), state)

    # Execute: restarted with --new-ledger while the run is in progress, then a new run
    restarted = open_coordinator(config, state_dir, new_ledger=True)
    (state_dir / CHECKPOINT_FILE).unlink()  # the operator moves the finished run aside
    next_run = open_coordinator(config, state_dir)
    new_ledger = open_coordinator(config, state_dir, new_ledger=True)

    # Assert
    assert spent > 0
    assert restarted.client_epsilons == {"client-0": spent}  # ignored: the run keeps it
    assert next_run.client_epsilons == {"client-0": spent}  # a new run continues it
    assert new_ledger.client_epsilons == {}


def test_key_holder_parties_read_the_set_a_round_closed_with(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the key holder's answer is the moment parties ask (they are asked while the
    # key holder applies the round)
    seen: list[frozenset[str]] = []

    def apply_round(_: ClusterPeers, application: RoundApplication) -> AppliedRound:
        seen.append(coordinator.closed.get(application.round))
        return AppliedRound(3, 2, 2.0, 0.1)

    monkeypatch.setattr(ClusterPeers, "apply_round", apply_round)
    for index in range(3):
        _register(coordinator, index=index)
    cohort = frozenset({"client-0", "client-1", "client-2"})
    accepted = frozenset({"client-0", "client-2"})
    opened = OpenRound(round=3, version=2, deadline=math.inf, cohort=cohort)
    with pytest.raises(InvalidArgumentError, match="round 3 is not a round being applied"):
        coordinator.closed.get(3)
    # Execute
    coordinator._apply(opened, accepted, RoundRecord(3, 2, 0))
    # Assert: exactly the accepted set, not the cohort; kept for the parties' retries
    assert seen == [accepted]
    assert coordinator.closed.get(3) == accepted
