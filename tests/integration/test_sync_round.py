"""End to end on loopback: real gRPC servers, real CKKS, real Opacus training."""

from __future__ import annotations

import numpy as np
import pytest

from clients.edge_client import EdgeClient
from tests.conftest import Cluster, run_clients

pytestmark = pytest.mark.integration


class RecordingClient(EdgeClient):
    """A real client that also keeps the plaintext of what it encrypted, for the replay."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: dict[int, tuple[float, np.ndarray]] = {}

    def push(self, round_: int, version: int, delta: np.ndarray) -> int:
        weight = self.trainer.num_examples / self.config.he.weight_unit
        self.sent[round_] = (weight, delta.copy())
        return super().push(round_, version, delta)


def test_applied_model_equals_plaintext_fedavg(cluster: Cluster) -> None:
    # Prepare
    config = cluster.config
    clients = [RecordingClient(config, index=i) for i in range(config.training.clients)]
    initial = cluster.coordinator.evaluator.initial_vector()

    # Execute
    run_clients(clients)

    # Assert
    expected = initial.copy()
    for round_ in range(1, config.training.rounds + 1):
        sent = [c.sent[round_] for c in clients]
        total = sum(w for w, _ in sent)
        expected = expected + sum(w * d for w, d in sent) / total
    applied = cluster.keyholder.params
    assert applied is not None
    assert cluster.keyholder.version == config.training.rounds
    rel = np.linalg.norm(applied - expected) / np.linalg.norm(expected)
    assert rel < 1e-4
    assert cluster.coordinator.finished
    assert all(r.contributors == 3 for r in cluster.coordinator.history)
