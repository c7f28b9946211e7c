"""End to end on loopback: real gRPC servers, real CKKS, real Opacus training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.edge_client import EdgeClient
from fedps.errors import InvalidArgumentError
from fedps.rpc import transport
from tests.conftest import Cluster, RecordingClient, run_clients, start_cluster
from tests.waiting import HANG_S

pytestmark = pytest.mark.integration


def test_applied_model_equals_plaintext_fedavg(cluster: Cluster) -> None:
    # Prepare
    config = cluster.config
    clients = [RecordingClient.open(config, index=i) for i in range(config.training.clients)]
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


def test_encryption_off_baseline_trains_the_same_way(tmp_path: Path) -> None:
    """The insecure plaintext baseline (for benchmarks) gives the same FedAvg result."""
    # Prepare
    cluster = start_cluster(
        tmp_path, training={"rounds": 1, "clients": 2, "min_quorum": 2}, he={"enabled": False}
    )
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        initial = cluster.coordinator.evaluator.initial_vector()
        # Execute
        run_clients(clients)
        # Assert
        sent = [c.sent[1] for c in clients]
        expected = initial + sum(w * d for w, d in sent) / sum(w for w, _ in sent)
        applied = cluster.keyholder.params
        assert applied is not None
        np.testing.assert_allclose(applied, expected, rtol=1e-9, atol=1e-12)
    finally:
        cluster.stop()


def test_client_refuses_a_downgrade_to_plaintext(tmp_path: Path) -> None:
    """A key holder without encryption cannot talk an encrypting client into plaintext."""
    # Prepare
    cluster = start_cluster(
        tmp_path, training={"rounds": 1, "clients": 1, "min_quorum": 1}, he={"enabled": False}
    )
    try:
        secure = cluster.config.model_copy(
            update={"he": cluster.config.he.model_copy(update={"enabled": True})}
        )
        client = EdgeClient.open(secure, index=0)
        # Execute / Assert
        with pytest.raises(InvalidArgumentError, match="no encryption"):
            client.run(timeout_s=HANG_S)
    finally:
        cluster.stop()


def test_key_rotation_every_round_keeps_training_exact(tmp_path: Path) -> None:
    """With a new key pair after every round, clients follow the new context and the applied
    model still equals the plaintext FedAvg of what they sent."""
    # Prepare
    cluster = start_cluster(
        tmp_path,
        training={"rounds": 2, "clients": 2, "min_quorum": 2},
        security={"rotate_every_rounds": 1},
    )
    try:
        first_context = cluster.keyholder.keys.public.context_id
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        initial = cluster.coordinator.evaluator.initial_vector()
        # Execute
        run_clients(clients)
        # Assert: no update was refused for its key (every client followed the new context)
        assert cluster.keyholder.keys.public.context_id != first_context
        assert not [k for c in clients for k in c.peer_failures if "invalid_argument" in k]
        expected = initial.copy()
        for round_ in (1, 2):
            sent = [c.sent[round_] for c in clients]
            expected = expected + sum(w * d for w, d in sent) / sum(w for w, _ in sent)
        applied = cluster.keyholder.params
        assert applied is not None
        assert np.linalg.norm(applied - expected) / np.linalg.norm(expected) < 1e-4
    finally:
        cluster.stop()


def test_a_push_in_many_messages_carries_its_commitment_once_and_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: messages of about one block each, so every shard gets a stream of several
    monkeypatch.setattr(transport, "TARGET_MESSAGE_BYTES", 1)
    cluster = start_cluster(tmp_path, training={"rounds": 1, "clients": 2, "min_quorum": 2})
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        initial = cluster.coordinator.evaluator.initial_vector()
        # Execute
        run_clients(clients)
        # Assert: only each stream's first message carried the signed commitment, and every
        # block was taken (the round applied the plaintext FedAvg of both updates)
        streams = []
        for client in clients:
            prepared = client.pusher.committed
            assert prepared is not None
            streams += list(prepared.messages.values())
        assert any(len(messages) > 1 for messages in streams)
        for messages in streams:
            assert messages[0].roots and messages[0].signature
            assert all(not m.roots and not m.signature for m in messages[1:])
        sent = [c.sent[1] for c in clients]
        expected = initial + sum(w * d for w, d in sent) / sum(w for w, _ in sent)
        applied = cluster.keyholder.params
        assert applied is not None
        rel = np.linalg.norm(applied - expected) / np.linalg.norm(expected)
        assert rel < 1e-4
    finally:
        cluster.stop()
