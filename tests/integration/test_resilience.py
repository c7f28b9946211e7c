"""Dropouts, restarts and key custody with real servers on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from clients.edge_client import EdgeClient
from crypto import SecretContext, _seal_io
from fedps.errors import FedPSError
from fedps.rpc.transport import bind, create_server
from fedps.runtime.cluster_status import print_status
from fedps.runtime.deployment import write_config
from server.serve import add_keyholder, add_shard, open_coordinator
from tests.conftest import Cluster, end_commits_once_in, run_clients, start_cluster
from tests.simulated_dropouts import SimulatedDropouts
from tests.waiting import HANG_S, wait_for

pytestmark = pytest.mark.integration

# The accuracy a run with 30% of clients dying mid-round must reach (digits, 4 clients, 30
# rounds, target epsilon 7.5). The demo's own bar (>= 90% without dropouts) is checked by
# tests/integration/test_demo.py. With dropouts fewer updates carry the same noise, and with the
# secure noise (fresh each run) one run's accuracy spreads by a few points: seeds 0-4 of the
# earlier seeded noise gave 91.4-93.3% (docs/results/dropout), one run with the secure noise
# 89.2%. The bar sits below that spread, so the test checks that dropouts do not break
# training (a run that learns nothing stays near 10%), not the luck of one draw.
DROPOUT_REQUIRED_ACCURACY = 0.87


def test_killed_client_does_not_stop_the_round(tmp_path: Path) -> None:
    # Prepare: three clients, quorum two; client 2 is a real process. The round ends at its
    # deadline (the victim never commits), which the test brings forward to the moment both
    # survivors have committed: the configured one is only a hang guard, so a loaded machine's
    # survivors always make the round, and nobody waits for it.
    cluster = start_cluster(
        tmp_path,
        training={"rounds": 1, "clients": 3, "min_quorum": 2, "deadline_s": 300.0},
    )
    try:
        config_path = tmp_path / "fedps.toml"
        write_config(cluster.config, config_path)
        victim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedps.cli",
                "client",
                "--index",
                "2",
                "--config",
                str(config_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        survivors = [EdgeClient.open(cluster.config, index=i) for i in range(2)]
        killer_done = threading.Event()

        def kill_when_round_opens() -> None:
            wait_for(
                lambda: cluster.coordinator.desk.open_round is not None, "round 1", poll_s=0.02
            )
            victim.send_signal(signal.SIGKILL)
            end_commits_once_in(cluster.coordinator, {"client-0", "client-1"})
            killer_done.set()

        threading.Thread(target=kill_when_round_opens, daemon=True).start()

        # Execute
        run_clients(survivors)

        # Assert
        assert killer_done.is_set()
        assert victim.wait(10) == -signal.SIGKILL
        record = cluster.coordinator.history[0]
        assert not record.abandoned
        assert record.contributors == 2
        assert cluster.keyholder.version == 1
    finally:
        cluster.stop()


def test_coordinator_restart_resumes_from_checkpoint(tmp_path: Path) -> None:
    # Prepare: two rounds, checkpoint every round
    training = {"rounds": 2, "clients": 2, "min_quorum": 2, "checkpoint_every": 1}
    cluster = start_cluster(tmp_path, training=training)
    run_clients([EdgeClient.open(cluster.config, index=i) for i in range(2)])
    model_after_2 = cluster.keyholder.params.copy()  # type: ignore[union-attr]
    cluster.coordinator.stop()

    # Execute: a new coordinator on the same state directory, asked for four rounds
    config = cluster.config.model_copy(
        update={"training": cluster.config.training.model_copy(update={"rounds": 4})}
    )
    restarted = open_coordinator(config, tmp_path / "state" / "coordinator")

    # Assert: round, version and model come back from the checkpoint
    assert (restarted.round, restarted.version) == (2, 2)
    assert [r.round for r in restarted.history] == [1, 2]
    np.testing.assert_allclose(restarted._vector, model_after_2, rtol=1e-6, atol=1e-6)
    cluster.stop()


def test_no_secret_key_outside_the_key_holder(cluster: Cluster) -> None:
    # Prepare
    clients = [
        EdgeClient.open(cluster.config, index=i) for i in range(cluster.config.training.clients)
    ]
    run_clients(clients)
    keys = cluster.keyholder.keys
    assert isinstance(keys, SecretContext)
    secret = _seal_io.uncompressed_body(_seal_io.save_bytes(keys._secret_key))
    key_dir = cluster.state_dir / "keyholder" / "keys"
    probes = [secret[i : i + 64] for i in range(64, len(secret) - 64, 4096)]

    # Execute: every file any role wrote, except the key holder's own key directory
    written = [p for p in cluster.state_dir.rglob("*") if p.is_file() and key_dir not in p.parents]
    scratch = _seal_io.scratch_root()
    written += [Path(scratch) / f for f in os.listdir(scratch)]

    # Assert
    assert written, "expected the coordinator and key holder to have written state"
    for path in written:
        data = path.read_bytes()
        assert not any(p in data for p in probes), f"{path} contains secret-key material"
    for client in clients:
        assert not hasattr(client.session.encryptor.public, "_secret_key")  # type: ignore[union-attr]
    for shard in cluster.shards:
        public = shard._public_context(cluster.keyholder.keys.public.context_id)
        assert not hasattr(public, "_secret_key")
    assert oct((key_dir / "secret.key").stat().st_mode & 0o777) == "0o600"


def test_lost_secret_key_is_reported_not_replaced(tmp_path: Path) -> None:
    # Prepare: a key holder with a model, then its secret key file disappears
    cluster = start_cluster(tmp_path, coordinator=False)
    cluster.keyholder.initialize(np.zeros(3000))
    cluster.stop()
    (cluster.state_dir / "keyholder" / "keys" / "secret.key").unlink()
    # Execute / Assert: a restart refuses instead of generating new keys
    with pytest.raises(FedPSError, match="secret key of this run is lost"):
        add_keyholder(create_server(), cluster.config, cluster.state_dir / "keyholder")
    assert not (cluster.state_dir / "keyholder" / "keys" / "secret.key").exists()


@pytest.mark.slow
def test_thirty_percent_dropout_still_trains_the_model(tmp_path: Path) -> None:
    # Prepare: the demo's training (4 clients, 30 rounds, target epsilon 7.5); in every
    # round each client dies mid-round with probability 0.3 (trains, never pushes). The
    # deadline is a hang guard: a round with a death closes as at its deadline, once the
    # others have committed (SimulatedDropouts), however long a loaded machine takes.
    cluster = start_cluster(tmp_path, training={"dropout": 0.3, "deadline_s": 60.0})
    try:
        dropouts = SimulatedDropouts(cluster)
        clients = [
            EdgeClient.open(cluster.config, index=i, mods=dropouts.mods(i)) for i in range(4)
        ]
        # Execute
        run_clients(clients, timeout_s=2 * HANG_S)
        # Assert: rounds closed at the deadline with whoever pushed, within the budget, and
        # the model learned (see DROPOUT_REQUIRED_ACCURACY for the figures measured)
        history = cluster.coordinator.history
        assert cluster.coordinator.finished and len(history) == 30
        assert sum(1 for r in history if 0 < r.contributors < 4 and not r.abandoned) >= 10
        assert max(c.trainer.epsilon() for c in clients) <= 7.5
        assert history[-1].accuracy >= DROPOUT_REQUIRED_ACCURACY
    finally:
        cluster.stop()


def test_status_shows_a_killed_shard_down_then_up_after_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a running cluster with a published model
    cluster = start_cluster(tmp_path, training={"rounds": 1, "clients": 2, "min_quorum": 2})
    try:
        run_clients([EdgeClient.open(cluster.config, index=i) for i in range(2)])
        address = cluster.config.cluster.shards[1]
        # Execute: shard-1 dies; then a new process of it starts on the same address
        cluster.servers["shard-1"].stop(grace=None)
        print_status(cluster.config)
        down = capsys.readouterr().out
        server = create_server()
        bind(server, address)
        restarted = add_shard(server, cluster.config, 1)
        server.start()
        cluster.servers["shard-1"] = server
        print_status(cluster.config)
        up = capsys.readouterr().out
        # Assert: DOWN, then up again with the model it had published (from its own disk)
        assert f"shard-1 {address}: DOWN" in down
        assert f"shard-1 {address}: up, version 1" in up
        assert restarted.version == 1
        # ... and the privacy of the run: the noise mode and each client's epsilon
        assert "DP noise: secure\n" in up
        for client_id, spent in cluster.coordinator.client_epsilons.items():
            assert f"{client_id}: epsilon {spent:.3f}" in up
    finally:
        cluster.stop()
