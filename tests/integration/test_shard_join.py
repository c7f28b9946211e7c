"""Shards that join a running deployment, on a cluster of real processes.

Key holder, three shards and the coordinator run as ``python -m fedps.cli ROLE`` processes; three
clients record the plaintext of what they pushed. The operator adds a shard while round 1's
pushes come in (``JoinShard``, as ``fedps shard --join`` calls it): it joins the ring between
rounds, takes about ``1 / S`` of the blocks, the key holder publishes them to it, and training
must finish with every round applied with exactly the acknowledged clients and the key holder's
model equal to the plaintext replay, the joined shard holding its share of every later round.

A shard declared gone that comes back holds the old state: the coordinator refuses to add it
until it is started empty (``fedps shard --empty`` sets its rounds and model aside), then it
joins like a new one.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from fedps.errors import InvalidArgumentError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.shard_messages import ShardStatus
from fedps.rpc.shard_stub import ShardStub
from fedps.runtime.deployment import Deployment, free_port
from fedps.sharding.ring_view import RingView
from tests.conftest import RecordingClient, run_clients
from tests.process_cluster import (
    HANG_S,
    assert_exported,
    assert_replayed,
    cluster_config,
    exported_model,
    recorded,
    start_servers,
    wait_for_round,
    wait_ready,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROUNDS = 3
CLIENTS = 3
#: the training section of each mode (async: a buffer of every client, as a sync round)
MODES: dict[str, dict[str, object]] = {
    "sync": {},
    "async": {"mode": "async", "buffer_size": CLIENTS, "max_staleness": 2},
}


def _shard_status(address: str, sid: str) -> ShardStatus:
    """Shard ``sid``'s status (one call)."""
    stub = ShardStub(sid, address)
    try:
        return stub.get_status(timeout_s=HANG_S)
    finally:
        stub.close()


def _operator(config_address: str) -> CoordinatorStub:
    return CoordinatorStub(config_address)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_shard_added_mid_run_takes_its_blocks_and_loses_nothing(
    tmp_path: Path, mode: str
) -> None:
    # Prepare: shard-2 is configured as a standby (served, off the ring); the operator adds it
    # right after shard-0 acknowledged client 0's push of round 1
    config, path = cluster_config(
        tmp_path,
        rounds=ROUNDS,
        clients=CLIENTS,
        training=MODES[mode],
        cluster={
            "shards": [f"127.0.0.1:{free_port()}" for _ in range(3)],
            "standby": ["shard-2"],
        },
    )
    deployment = Deployment(path, config)
    operator = _operator(config.cluster.coordinator)
    joined = threading.Event()
    try:
        start_servers(deployment)
        assert _shard_status(config.cluster.shards[2], "shard-2").blocks == 0
        clients = [RecordingClient.open(config, index=i, peer_wait_s=10.0) for i in range(CLIENTS)]
        first = clients[0]

        def join_after_ack(round_: int, sid: str) -> None:
            first.acknowledged_by(round_, sid)
            if not joined.is_set():
                joined.set()
                operator.join_shard("shard-2")
                with pytest.raises(InvalidArgumentError, match="already"):
                    operator.join_shard("shard-2")

        first.pusher.on_acknowledged = join_after_ack

        # Execute
        run_clients(clients, timeout_s=HANG_S)
        final = wait_for_round(config, ROUNDS, finished=True)
        added = _shard_status(config.cluster.shards[2], "shard-2")
        exported = exported_model(config)
    finally:
        operator.close()
        log = (deployment.log_dir / "coordinator.log").read_text()
        deployment.stop()

    # Assert: the ring took shard-2 between rounds 1 and 2, it owns its share of the blocks and
    # holds every later round's pushes of them, and nothing acknowledged was lost
    assert joined.is_set()
    nodes = ("shard-0", "shard-1", "shard-2")
    assert (final.ring_version, final.ring_nodes) == (1, nodes), log[-4000:]
    assert final.ring_moves == ("version 1: shard-2 added (joined by the operator)",)
    assert all(c.session.ring_view == RingView(1, nodes) for c in clients)
    blocks = first.session.layout.num_blocks
    expected = RingView(1, nodes).ring(config.cluster.virtual_nodes).assignment(blocks)["shard-2"]
    assert added.blocks == len(expected) > 0
    assert added.pushes_accepted == (ROUNDS - 1) * CLIENTS * len(expected)
    assert_replayed(config, final, recorded(clients), log[-4000:])
    assert_exported(config, exported)  # export reads the joined shard's blocks too


def test_a_shard_declared_gone_rejoins_only_empty(tmp_path: Path) -> None:
    # Prepare: shard-1 dies (SIGKILL) right after it acknowledged client 0's push of round 1
    # and is declared gone; in round 2 it comes back with its old state, then empty
    config, path = cluster_config(
        tmp_path,
        rounds=ROUNDS,
        clients=CLIENTS,
        cluster={
            "shard_gone_after_s": 2.0,
            "shards": [f"127.0.0.1:{free_port()}" for _ in range(3)],
        },
    )
    deployment = Deployment(path, config)
    operator = _operator(config.cluster.coordinator)
    killed, back = threading.Event(), threading.Event()
    refusals: list[str] = []
    try:
        start_servers(deployment)
        clients = [RecordingClient.open(config, index=i, peer_wait_s=10.0) for i in range(CLIENTS)]
        first = clients[0]

        def restart(*args: str) -> None:
            deployment.start("shard-1", "shard", "--index", "1", *args)
            wait_ready(deployment, ["shard-1"])

        def lose_then_rejoin(round_: int, sid: str) -> None:
            first.acknowledged_by(round_, sid)
            if round_ == 1 and sid == "shard-1" and not killed.is_set():
                killed.set()
                process = deployment.processes["shard-1"]
                process.send_signal(signal.SIGKILL)
                process.wait(HANG_S)
            elif round_ == 2 and not back.is_set():
                back.set()
                restart()  # its old log and model: refused
                with pytest.raises(InvalidArgumentError, match="holds version") as refused:
                    operator.join_shard("shard-1")
                refusals.append(str(refused.value))
                process = deployment.processes["shard-1"]
                process.send_signal(signal.SIGTERM)
                process.wait(HANG_S)
                restart("--empty")
                operator.join_shard("shard-1")

        first.pusher.on_acknowledged = lose_then_rejoin

        # Execute
        run_clients(clients, timeout_s=HANG_S)
        final = wait_for_round(config, ROUNDS, finished=True)
        rejoined = _shard_status(config.cluster.shards[1], "shard-1")
        exported = exported_model(config)
    finally:
        operator.close()
        log = (deployment.log_dir / "coordinator.log").read_text()
        deployment.stop()

    # Assert: removed at version 1, back at version 2 with its old state set aside, holding
    # round 3's pushes of its blocks; nothing acknowledged was lost
    assert killed.is_set() and back.is_set() and refusals
    nodes = ("shard-0", "shard-1", "shard-2")
    assert (final.ring_version, final.ring_nodes) == (2, nodes), log[-4000:]
    assert [m.split(" (")[0] for m in final.ring_moves] == [
        "version 1: shard-1 removed",
        "version 2: shard-1 added",
    ]
    assert list((config.cluster.state_dir / "shard-1").glob("discarded-*/log"))
    blocks = first.session.layout.num_blocks
    owned = RingView(2, nodes).ring(config.cluster.virtual_nodes).assignment(blocks)["shard-1"]
    assert rejoined.version == ROUNDS and rejoined.blocks == len(owned) > 0
    assert rejoined.pushes_accepted == CLIENTS * len(owned)
    assert_replayed(config, final, recorded(clients), log[-4000:])
    assert_exported(config, exported)
