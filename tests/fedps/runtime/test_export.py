"""``fedps export``: the trained model as a state_dict, refused unless the key holder signed it.

One real cluster on loopback (key holder, 2 shards, coordinator) trains 2 rounds of the
built-in digits task with 3 clients; every test then runs ``fedps export`` as a process
against it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from clients.edge_client import EdgeClient
from crypto.files import read_checked, write_checked
from crypto.signing import model_block_digest
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, InvalidArgumentError
from fedps.learning.tasks import evaluate_model, load_task
from fedps.proto import shard_pb2
from fedps.runtime.deployment import write_config
from fedps.runtime.export import pull_model, read_saved_model
from server.coordinator.checkpoint_store import CheckpointStore
from tests.conftest import Cluster, run_clients, start_cluster, start_coordinator
from tests.role_processes import last_line, run_fedps

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster that trained 2 rounds of digits and keeps serving its model."""
    root = tmp_path_factory.mktemp("export")
    training = {"rounds": 2, "clients": 3, "min_quorum": 3, "deadline_s": 300.0, "lr": 0.3}
    cluster = start_cluster(root, coordinator=False, training=training)
    try:
        clients = [EdgeClient.open(cluster.config, index=i) for i in range(3)]
        start_coordinator(cluster)
        run_clients(clients)
        yield cluster
    finally:
        cluster.stop()


def _config_file(config: FedPSConfig, path: Path, **security: object) -> Path:
    """``config`` with ``security`` fields replaced, written to ``path``."""
    write_config(
        config.model_copy(update={"security": config.security.model_copy(update=security)}),
        path,
    )
    return path


def test_export_writes_the_model_the_coordinator_evaluated(
    trained: Cluster, tmp_path: Path
) -> None:
    # Prepare: the key holder's key pinned, as an operator would from keys/signing.pub
    key = trained.keyholder.signer.public_key.hex()
    config = _config_file(trained.config, tmp_path / "fedps.toml", keyholder_key=key)
    out = tmp_path / "model.pt"
    task = load_task(trained.config)

    # Execute
    result = run_fedps("export", "-c", str(config), "-o", str(out))

    # Assert: the file loads into the task's model and scores what the coordinator reported
    assert result.returncode == 0, result.stderr
    assert f"model version 2 written to {out}" in result.stdout
    model = task.create_model(trained.config.training.seed)
    model.load_state_dict(torch.load(out))
    eval_data = task.eval_data()
    assert eval_data is not None
    metrics = evaluate_model(task, model, eval_data)
    last = trained.coordinator.history[-1]
    # trained (chance is 0.1 on ten digits; DP noise makes 2 rounds land anywhere 0.4-0.9)
    assert last.round == 2 and last.accuracy > 0.25
    assert metrics["accuracy"] == pytest.approx(last.accuracy, abs=1e-6)
    assert metrics["loss"] == pytest.approx(last.loss, abs=1e-6)


def test_export_refuses_a_block_a_shard_altered(trained: Cluster, tmp_path: Path) -> None:
    # Prepare: a shard serves one block changed after the key holder signed it
    config = _config_file(trained.config, tmp_path / "fedps.toml")
    out = tmp_path / "model.pt"
    shard = next(s for s in trained.shards if s.owned_blocks)
    block = shard.owned_blocks[0]
    honest = shard.model._values[block].copy()
    shard.model._values[block] = honest + np.float32(0.5)

    # Execute
    try:
        result = run_fedps("export", "-c", str(config), "-o", str(out))
    finally:
        shard.model._values[block] = honest

    # Assert: one line, exit 2, and no file
    assert result.returncode == 2, result.stderr
    line = last_line(result.stderr)
    assert line.startswith("fedps: error:"), result.stderr
    assert f"block {block} without a valid key-holder signature" in line
    assert "refusing" in line
    assert not out.exists()


def test_export_refuses_a_key_holder_that_is_not_the_pinned_one(
    trained: Cluster, tmp_path: Path
) -> None:
    # Prepare: some other key pinned
    config = _config_file(trained.config, tmp_path / "fedps.toml", keyholder_key="ab" * 32)
    out = tmp_path / "model.pt"

    # Execute
    result = run_fedps("export", "-c", str(config), "-o", str(out))

    # Assert
    assert result.returncode == 2, result.stderr
    assert last_line(result.stderr) == (
        "fedps: error: the key holder's signing key does not match security.keyholder_key "
        "(pinned); refusing its model"
    )
    assert not out.exists()


def test_export_refuses_a_model_that_does_not_fit_the_task(
    trained: Cluster, tmp_path: Path
) -> None:
    # Prepare: the configuration names another model than the cluster trained
    training = trained.config.training.model_copy(update={"model": "logreg"})
    config = tmp_path / "fedps.toml"
    write_config(trained.config.model_copy(update={"training": training}), config)
    out = tmp_path / "model.pt"

    # Execute
    result = run_fedps("export", "-c", str(config), "-o", str(out))

    # Assert
    assert result.returncode == 2, result.stderr
    line = last_line(result.stderr)
    assert line.startswith("fedps: error: the published model has "), result.stderr
    assert "task 'digits'" in line
    assert not out.exists()


def _state_copy(trained: Cluster, root: Path) -> FedPSConfig:
    """The trained cluster's configuration over a copy of what a stopped cluster leaves: each
    shard's saved model and the key holder's public signing key."""
    source = trained.config.cluster.state_dir
    for sid in trained.config.cluster.shard_ids:
        (root / sid).mkdir(parents=True)
        shutil.copy(source / sid / "model.pb", root / sid / "model.pb")
    (root / "keyholder" / "keys").mkdir(parents=True)
    shutil.copy(source / "keyholder" / "keys" / "signing.pub", root / "keyholder" / "keys")
    cluster = trained.config.cluster.model_copy(update={"state_dir": root})
    return trained.config.model_copy(update={"cluster": cluster})


def test_a_stopped_cluster_s_saved_model_is_read_and_verified(
    trained: Cluster, tmp_path: Path
) -> None:
    # Prepare
    config = _state_copy(trained, tmp_path / "state")
    online, _ = pull_model(trained.config)
    # Execute
    saved, version = read_saved_model(config)
    # Assert: the model the shards serve
    assert version == 2
    for name, value in online.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[name], value)


def test_a_saved_block_changed_on_disk_is_refused(trained: Cluster, tmp_path: Path) -> None:
    # Prepare: one value of shard-0's saved model changed, the file's checksum made to match
    config = _state_copy(trained, tmp_path / "state")
    path = config.cluster.state_dir / "shard-0" / "model.pb"
    saved = shard_pb2.PublishRequest.FromString(
        read_checked(path, what="the published model", hint="") or b""
    )
    values = bytearray(saved.blocks[0].values)
    values[0] ^= 0x40
    saved.blocks[0].values = bytes(values)
    write_checked(path, saved.SerializeToString())
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="does not verify"):
        read_saved_model(config)


def _resign(trained: Cluster, path: Path, *, version: int, envelope: int) -> None:
    """Rewrite a saved model with every block validly signed by the key holder for
    ``version`` (an older model a shard could have kept), in a file that says ``envelope``."""
    saved = shard_pb2.PublishRequest.FromString(
        read_checked(path, what="the published model", hint="") or b""
    )
    saved.version = envelope
    for block in saved.blocks:
        block.version = version
        block.signature = trained.keyholder.signer.sign(
            model_block_digest(version, block.block, block.values)
        )
    write_checked(path, saved.SerializeToString())


@pytest.mark.parametrize("envelope", [1, 2])
def test_a_shard_cannot_roll_the_saved_model_back(
    trained: Cluster, tmp_path: Path, envelope: int
) -> None:
    # Prepare: shard-0's file holds blocks the key holder really signed, for version 1, in a
    # file that says version 1 (an old file) or 2 (the blocks mixed into the new model)
    config = _state_copy(trained, tmp_path / "state")
    shutil.copy(
        trained.config.cluster.state_dir / "keyholder" / "keyholder-state.npz",
        config.cluster.state_dir / "keyholder",
    )
    _resign(
        trained, config.cluster.state_dir / "shard-0" / "model.pb", version=1, envelope=envelope
    )
    # Execute / Assert
    with pytest.raises(FedPSError, match="version"):
        read_saved_model(config)


def _checkpointed_ring(config: FedPSConfig, version: int, nodes: list[str]) -> None:
    """A coordinator checkpoint in ``config``'s state folder whose ring is ``nodes``."""
    ring = {"version": version, "nodes": nodes, "moves": [], "joining": []}
    store = CheckpointStore(config.cluster.state_dir / "coordinator")
    store.save(np.zeros(1), {"round": 2, "ring": ring})


def test_the_saved_model_is_read_on_the_checkpointed_ring(trained: Cluster, tmp_path: Path) -> None:
    # Prepare: the checkpointed ring is the configured one (shard-0 and shard-1, version 0)
    # but for shard-1's file, which a shard declared gone would have left older or damaged
    config = _state_copy(trained, tmp_path / "state")
    _checkpointed_ring(config, 0, ["shard-0", "shard-1"])
    (config.cluster.state_dir / "shard-1" / "model.pb").write_bytes(b"not a model")
    with pytest.raises(FedPSError, match="shard-1"):
        read_saved_model(config)
    # Execute / Assert: shard-1 declared gone (ring version 1), and the key holder had not
    # published on the new ring: shard-0's file holds only its own blocks of version 0
    _checkpointed_ring(config, 1, ["shard-0"])
    with pytest.raises(FedPSError, match="ring version 0, not of version 1"):
        read_saved_model(config)
