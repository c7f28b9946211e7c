"""The roles' metrics endpoints after a real run on loopback: the coordinator's answer the
operator (accuracy, privacy spend, round durations), and each role exports only its own."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import pytest

from clients.edge_client import EdgeClient
from fedps.runtime.deployment import free_port
from tests.conftest import coordinator_status, run_clients, start_cluster
from tests.server.test_metrics import names, samples

pytestmark = pytest.mark.integration

ROUNDS = 3


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as reply:
        return str(reply.read().decode())


def test_each_role_exports_its_own_metrics_after_a_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a cluster whose three kinds of role serve metrics on loopback
    metrics = {
        "keyholder": f"127.0.0.1:{free_port()}",
        "coordinator": f"127.0.0.1:{free_port()}",
        "shards": [f"127.0.0.1:{free_port()}"],
    }
    training = {"rounds": ROUNDS, "clients": 2, "min_quorum": 2, "deadline_s": 30.0, "lr": 0.3}
    cluster = start_cluster(tmp_path, num_shards=1, training=training, metrics=metrics)
    try:
        clients = [EdgeClient.open(cluster.config, index=i) for i in range(2)]
        # Execute
        with caplog.at_level(logging.INFO, logger="fedps"):
            run_clients(clients)
        addresses = cluster.config.metrics
        coordinator = _scrape(addresses.coordinator)
        keyholder = _scrape(addresses.keyholder)
        shard = _scrape(addresses.shards[0])
        status = coordinator_status(cluster.config.cluster.coordinator)
    finally:
        cluster.stop()
    # Assert: the coordinator's page carries the last round's accuracy and the status's spend
    assert status is not None
    got = samples(coordinator)
    last = cluster.coordinator.history[-1]
    assert 0.0 <= got[("fedps_accuracy", ())] <= 1.0
    assert got[("fedps_accuracy", ())] == pytest.approx(last.accuracy)
    assert got[("fedps_loss", ())] == pytest.approx(last.loss)
    assert got[("fedps_epsilon_max", ())] == pytest.approx(status.max_epsilon)
    assert status.max_epsilon > 0
    assert got[("fedps_delta", ())] == pytest.approx(status.delta)
    for client, epsilon in status.client_epsilons.items():
        assert got[("fedps_client_epsilon", (("client", client),))] == pytest.approx(epsilon)
    assert sorted(status.client_epsilons) == ["client-0", "client-1"]
    assert got[("fedps_round_seconds_count", ())] == len(cluster.coordinator.history) == ROUNDS
    assert got[("fedps_rounds", (("outcome", "applied"),))] == ROUNDS
    # ... the key holder's its refusals and applications, no shard's or coordinator's
    kh = samples(keyholder)
    assert kh[("fedps_seconds_count", (("operation", "apply"),))] == ROUNDS
    assert kh[("fedps_commitments_total", (("outcome", "accepted"), ("reason", "")))] == 2 * ROUNDS
    assert not {n for n in names(keyholder) if n.startswith(("fedps_pushes", "fedps_buffer"))}
    assert "fedps_accuracy" not in names(keyholder)
    # ... and the shard's its pushes, nothing of the run's accuracy or spend
    assert samples(shard)[("fedps_pushes_total", (("outcome", "accepted"), ("reason", "")))] > 0
    assert not {n for n in names(shard) if n.startswith(("fedps_accuracy", "fedps_epsilon"))}
    assert "fedps_tampering_detected_total" not in names(shard)
    # ... and the coordinator logged each round as one readable line, not a record's repr
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"round {ROUNDS}/{ROUNDS}: 2 clients, accuracy ") for m in logged)
    assert not [m for m in logged if "RoundRecord(" in m]
