"""End to end on loopback: client-level DP (DP-FedAvg) through real servers and real CKKS."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.edge_client import ClientSummary, EdgeClient
from fedps.accounting import epsilon
from tests.conftest import run_clients, start_cluster

pytestmark = pytest.mark.integration

ROUNDS = 5
CLIENTS = 3
# A generous budget: three clients are far too few for a useful client-level epsilon, but
# enough to check the mechanics end to end while the model still learns.
TARGET_EPSILON = 50.0


class RecordingClient(EdgeClient):
    """A real client that also keeps the weight and (noised) update it encrypted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: dict[int, tuple[float, np.ndarray]] = {}

    def push(self, round_: int, version: int, delta: np.ndarray) -> int:
        self.sent[round_] = (self.weight, delta.copy())
        return super().push(round_, version, delta)


def test_client_level_training_learns_within_budget(tmp_path: Path) -> None:
    # Prepare
    cluster = start_cluster(
        tmp_path,
        training={"rounds": ROUNDS, "clients": CLIENTS, "min_quorum": CLIENTS, "deadline_s": 30.0},
        privacy={"level": "client", "target_epsilon": TARGET_EPSILON, "clip_norm": 0.5},
    )
    try:
        clients = [RecordingClient(cluster.config, index=i) for i in range(CLIENTS)]
        initial = cluster.coordinator.evaluator.initial_vector()

        # Execute
        summaries = run_clients(clients)

        # Assert: every round applied, the model learned (chance is 0.1 on digits) ...
        coordinator = cluster.coordinator
        assert coordinator.finished
        assert [r.round for r in coordinator.history] == list(range(1, ROUNDS + 1))
        assert not any(r.abandoned for r in coordinator.history)
        assert coordinator.history[-1].accuracy > 0.25
        # ... every weight was 1.0 and the applied model is the plain mean of the updates ...
        expected = initial.copy()
        for round_ in range(1, ROUNDS + 1):
            sent = [c.sent[round_] for c in clients]
            assert [w for w, _ in sent] == [1.0] * CLIENTS
            expected = expected + sum(d for _, d in sent) / CLIENTS
        applied = cluster.keyholder.params
        assert applied is not None
        assert np.linalg.norm(applied - expected) / np.linalg.norm(expected) < 1e-4
        # ... and the epsilon reported is the accountant's for (sigma, q = 1, ROUNDS rounds).
        sigma = clients[0].trainer.noise_multiplier
        max_epsilon, delta = coordinator.max_epsilon
        assert max_epsilon <= TARGET_EPSILON
        assert max_epsilon == pytest.approx(epsilon(sigma, 1.0, ROUNDS, delta))
        for summary in summaries:
            assert isinstance(summary, ClientSummary)
            assert summary.rounds_trained == ROUNDS
            assert summary.epsilon <= TARGET_EPSILON
    finally:
        cluster.stop()
