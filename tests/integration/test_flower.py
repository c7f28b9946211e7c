"""A Flower app through Flower's own runtime, with fedps's encrypted aggregation.

The ServerApp runs :class:`server.flower.flower_strategy.FlowerStrategy` and the ClientApp is
:func:`clients.flower.flower_client.create_client_app`, both executed by Flower's simulation runtime
(``flwr.simulation.run_simulation``, Ray backend) against a real key holder and two shards on
loopback. The clients run in Ray's worker processes, so the test-only mod below writes the
plaintext of what it encrypted to disk, where the replay reads it.

Needs ``flwr[simulation]`` (Ray), installed with fedps's ``dev`` extra.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from clients.flower.flower_client import FlowerClient, create_client_app
from clients.train_step import TrainFn, TrainStep
from crypto.signing import BlockSigner
from fedps.bench.flower_bench import simulate
from fedps.config import FedPSConfig
from server.flower.flower_strategy import FlowerStrategy
from tests.conftest import start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 2
NODES = 3


@dataclass(frozen=True)
class Recorder:
    """A mod that saves the plaintext of each update a node encrypts (its weight and delta),
    so the test can replay FedAvg in plaintext."""

    record_dir: Path

    def __call__(
        self, step: TrainStep, params: np.ndarray, call_next: TrainFn
    ) -> np.ndarray | None:
        delta = call_next(step, params)
        if delta is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)
            path = self.record_dir / f"round{step.round}-{step.client_id}.npz"
            np.savez(path, weight=step.weight, delta=delta)
        return delta


def recording_client(
    config: FedPSConfig, *, index: int, signer: BlockSigner, record_dir: Path
) -> FlowerClient:
    """A real Flower node that also records what it encrypts (:class:`Recorder`)."""
    return FlowerClient(config, index=index, signer=signer, mods=[Recorder(record_dir)])


@pytest.mark.usefixtures("one_ray_node")
def test_flower_app_applies_the_plaintext_fedavg_of_the_encrypted_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: key holder and shards on loopback; the strategy is the coordinator.
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")  # offline: no telemetry events
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs; no Ray warning
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"rounds": ROUNDS, "clients": NODES, "min_quorum": NODES, "lr": 0.3},
        # The key holder floods each released sum with noise of 2**flood_bits times the
        # worst-case CKKS decryption error (IND-CPA^D mitigation, docs/security.md). Off
        # here, so the replay checks the aggregation at 1e-4, not the size of that noise.
        security={"flood_bits": 0},
    )
    strategy = FlowerStrategy(cluster.config, state_dir=tmp_path / "flower")
    initial = strategy.coordinator.evaluator.initial_vector().copy()
    results: list[Result] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = strategy.initial_arrays()
        results.append(strategy.start(grid=grid, initial_arrays=arrays, num_rounds=ROUNDS))

    record_dir = tmp_path / "sent"
    client_app = create_client_app(
        cluster.config,
        client_factory=functools.partial(recording_client, record_dir=record_dir),
    )

    # Execute: Flower's simulation runtime drives the ServerApp and 3 ClientApps.
    try:
        simulate(server_app, client_app, nodes=NODES, workers=2)
    finally:
        cluster.stop()

    # Assert
    assert len(results) == 1
    result = results[0]
    expected = initial.copy()
    for round_ in range(1, ROUNDS + 1):
        sent = [np.load(p) for p in sorted(record_dir.glob(f"round{round_}-*.npz"))]
        assert len(sent) == NODES
        total = sum(float(s["weight"]) for s in sent)
        expected = expected + sum(float(s["weight"]) * s["delta"] for s in sent) / total
    applied = cluster.keyholder.params
    assert applied is not None
    assert cluster.keyholder.version == ROUNDS
    rel = np.linalg.norm(applied - expected) / np.linalg.norm(expected)
    assert rel < 1e-4
    # What Flower returns is the model the key holder published (float32 on the shards).
    returned = np.concatenate([a.ravel() for a in result.arrays.to_numpy_ndarrays()])
    np.testing.assert_allclose(returned, applied, rtol=0, atol=1e-6)
    history = strategy.coordinator.history
    assert [r.contributors for r in history] == [NODES] * ROUNDS
    metrics = result.train_metrics_clientapp
    assert sorted(metrics) == [1, 2]
    assert all(
        m["contributors"] == NODES and cast(int, m["bytes-pushed"]) > 0 for m in metrics.values()
    )
    target = cast(float, cluster.config.privacy.target_epsilon)
    assert 0 < cast(float, metrics[ROUNDS]["max-epsilon"]) <= target
