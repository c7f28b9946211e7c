"""Shard failover on a cluster of real processes: a shard lost for good, training goes on.

Key holder, three shards and the coordinator run as ``python -m fedps.cli ROLE`` processes;
three clients record the plaintext of what they pushed. One shard is SIGKILLed mid-round, right
after it acknowledged a client's push, and never restarted: the coordinator declares it gone
(``cluster.shard_gone_after_s``), moves its blocks along the ring to the two shards left, the
clients push the moved blocks again, and training must finish with every round applied with
exactly the acknowledged clients and the key holder's model equal to the plaintext replay.

Cut off the network for good: shard-1 runs in its own network namespace (a second "host" on a
veth pair, :mod:`tests.network_namespace`), and the link is deleted at the same moment; its
process lives on, unreachable. The same must hold.

Under mutual TLS (the default configuration), the same with client processes, each with its
certificate, and shard-1 killed once it took a push of round 2. With key-holder parties
(``keyholder.parties = 3``), the parties fetch the round's sums from the moved ring.

After each run, ``fedps export`` (:func:`fedps.runtime.export.pull_model` while the cluster
runs, :func:`~fedps.runtime.export.read_saved_model` once it stopped) gives the model the
coordinator evaluated last: it reads the shards on the moved ring, not the configured ones.

The test prints the time from the shard's loss to the next applied round (``-s`` shows it);
``FEDPS_FAILOVER_MODEL=mlp1m`` runs it on the 1M-parameter model (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crypto.tls import OPERATOR_NAME
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import provision_cluster, setup_tls
from fedps.rpc.coordinator_messages import ClusterStatus
from fedps.runtime.deployment import Deployment, free_port, local_cluster, write_config
from server.coordinator.checkpoint_store import CheckpointStore
from server.keyholder.keyholder_party import LEDGER_FILE
from server.keyholder.party_process import party_folder
from tests.conftest import RecordingClient, run_clients
from tests.dying_coordinator import PREFIX as DYING_COORDINATOR
from tests.dying_shard import At
from tests.dying_shard import prefix as dying_prefix
from tests.network_namespace import isolated_host
from tests.party_processes import PARTIES, THRESHOLD, flooding_bound, start_party
from tests.process_cluster import (
    HANG_S,
    address_of,
    assert_exported,
    assert_replayed,
    cluster_config,
    exported_model,
    keyholder_state,
    recorded,
    role_args,
    start_servers,
    wait_for_round,
)
from tests.recording_client import load_recorded
from tests.role_processes import wait_serving
from tests.tampering_shard import prefix as tampering_prefix

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROUNDS = 3
CLIENTS = 3
KILLED = "shard-1"
GONE_AFTER_S = 2.0
#: the training section of each mode (async: a buffer of every client, as a sync round)
MODES: dict[str, dict[str, object]] = {
    "sync": {},
    "async": {"mode": "async", "buffer_size": CLIENTS, "max_staleness": 2},
}
MODEL = os.environ.get("FEDPS_FAILOVER_MODEL", "")  # "": the configuration's default model


def _applied_at(keyholder_log: str, round_: int) -> float:
    """When the key holder's log says it applied ``round_`` (Unix seconds)."""
    line = next(x for x in keyholder_log.splitlines() if f"fedps: applied round {round_} " in x)
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


@dataclass
class _Run:
    """What one run that lost shard-1 left: its configuration, logs, clients and final status."""

    config: FedPSConfig
    clients: list[RecordingClient]
    final: ClusterStatus
    log: str  # the coordinator's
    keyholder_log: str
    lost_at: float  # Unix seconds
    exported: tuple[np.ndarray, int]  # the model fedps export pulled once training finished


def _train_losing_shard_1(
    tmp_path: Path,
    mode: str,
    lose: Callable[[Deployment], None],
    cluster: dict[str, object] | None = None,
    prefixes: dict[str, list[str]] | None = None,
    parties: int = 1,
) -> _Run:
    """Train on three shards; ``lose`` loses shard-1 right after it acknowledged client 0's
    push of round 2, for good (``cluster``: more ``[cluster]`` fields; ``prefixes``: the
    deployment's command prefixes by role; ``parties``: key-holder parties, 1: none)."""
    config, path = cluster_config(
        tmp_path,
        rounds=ROUNDS,
        clients=CLIENTS,
        training={**MODES[mode], **({"model": MODEL} if MODEL else {})},
        cluster={
            "shard_gone_after_s": GONE_AFTER_S,
            "shards": [f"127.0.0.1:{free_port()}" for _ in range(3)],
            "parties": [f"127.0.0.1:{free_port()}" for _ in range(parties if parties > 1 else 0)],
            **(cluster or {}),
        },
        keyholder={"parties": parties, "threshold": THRESHOLD, "lambda_bits": 16}
        if parties > 1
        else {},
    )
    deployment = Deployment(path, config)
    deployment.prefixes.update(prefixes or {})
    lost = threading.Event()
    lost_at: list[float] = []
    try:
        for index in range(1, parties + 1) if parties > 1 else ():
            start_party(deployment, index)  # parties first, as fedps up starts them
        start_servers(deployment)
        clients = [RecordingClient.open(config, index=i, peer_wait_s=10.0) for i in range(CLIENTS)]
        first = clients[0]

        def lose_after_ack(round_: int, sid: str) -> None:
            first.acknowledged_by(round_, sid)
            if round_ == 2 and sid == KILLED and not lost.is_set():
                lost.set()
                lose(deployment)
                lost_at.append(time.time())

        first.pusher.on_acknowledged = lose_after_ack
        run_clients(clients, timeout_s=HANG_S)
        final = wait_for_round(config, ROUNDS, finished=True)
        exported = exported_model(config)
    finally:
        log = (deployment.log_dir / "coordinator.log").read_text()
        keyholder_log = (deployment.log_dir / "keyholder.log").read_text()
        deployment.stop()
    assert lost.is_set()
    return _Run(config, clients, final, log, keyholder_log, lost_at[0], exported)


def _assert_moved_on(
    run: _Run,
    how: str,
    within: Callable[[Mapping[str, Mapping[str, Any]]], float] | None = None,
    *,
    timed: bool = True,
) -> None:
    """The ring moved on without shard-1, nothing acknowledged was lost (``within``: as
    :func:`~tests.process_cluster.assert_replayed`), export follows the ring; prints the time
    from the loss to the next applied round (``timed``: the loss is the test's own)."""
    assert f"{KILLED} declared gone" in run.log, run.log[-4000:]
    assert all(c.session.ring_view.nodes == ("shard-0", "shard-2") for c in run.clients)
    checkpoint = CheckpointStore(run.config.cluster.state_dir / "coordinator").load()
    assert checkpoint is not None
    ring = checkpoint.state["ring"]  # a restarted coordinator goes on with the moved ring
    assert (ring["version"], ring["nodes"]) == (1, ["shard-0", "shard-2"])
    assert [m["removed"] for m in ring["moves"]] == [KILLED]
    assert_replayed(run.config, run.final, recorded(run.clients), run.log[-4000:], within=within)
    assert_exported(run.config, run.exported)
    if not timed:
        return
    loss_to_applied = _applied_at(run.keyholder_log, 2) - run.lost_at
    print(
        f"{run.config.training.model}: shard {how} -> round 2 applied in {loss_to_applied:.1f} s "
        f"(shard_gone_after_s {GONE_AFTER_S:g}); round 3 took {run.final.history[-1].seconds:.1f} s"
    )


def _alive(name: str, process: subprocess.Popen[bytes]) -> None:
    """Raise if ``process`` (role ``name``) exited."""
    assert process.poll() is None, f"{name} exited with code {process.returncode}"


def _sigkill_shard_1(deployment: Deployment) -> None:
    process = deployment.processes[KILLED]
    process.send_signal(signal.SIGKILL)
    process.wait(HANG_S)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_shard_sigkilled_for_good_moves_its_blocks_and_loses_nothing(
    tmp_path: Path, mode: str
) -> None:
    # Prepare, Execute: three shards; shard-1 dies (SIGKILL) right after it acknowledged
    # client 0's push of round 2, and is never restarted
    run = _train_losing_shard_1(tmp_path, mode, _sigkill_shard_1)

    # Assert: the ring moved on without shard-1, and nothing acknowledged was lost
    _assert_moved_on(run, "killed")


@pytest.mark.parametrize(
    ("mode", "at"), [("sync", "fetch"), ("async", "fetch"), ("sync", "publish")]
)
def test_a_shard_lost_after_its_round_closed_moves_its_blocks_and_loses_nothing(
    tmp_path: Path, mode: str, at: At
) -> None:
    # Prepare, Execute: shard-1's process dies (tests.dying_shard) when the key holder fetches
    # round 2's sums (the round closed, nothing decrypted: its pushes move with the ring) or
    # when round 2's version is published (the round applied: its version moves with the
    # ring), and is never restarted
    run = _train_losing_shard_1(
        tmp_path, mode, lambda _: None, prefixes={KILLED: dying_prefix(2, at)}
    )

    # Assert: the ring moved on without shard-1, and nothing acknowledged was lost
    _assert_moved_on(run, f"lost at the {at} of round 2", timed=False)
    pushed_again = "round 2: shard-1 is gone (after its round closed)"
    assert (pushed_again in run.log) == (at == "fetch"), run.log[-4000:]


def test_a_coordinator_and_key_holder_killed_mid_move_finish_it(tmp_path: Path) -> None:
    # Prepare: shard-1 is SIGKILLed right after it acknowledged client 0's push of round 2;
    # the coordinator's process dies the moment it saved the ring without shard-1
    # (tests.dying_coordinator: before anyone is told it, before the round is checkpointed on
    # it), and the key holder is SIGKILLed with it; both are restarted
    restarted: list[threading.Thread] = []

    def kill_and_restart(deployment: Deployment) -> None:
        deployment.processes["coordinator"].wait(HANG_S)  # it died moving the ring
        deployment.processes["keyholder"].send_signal(signal.SIGKILL)
        deployment.processes["keyholder"].wait(HANG_S)
        del deployment.prefixes["coordinator"]
        for name in ("keyholder", "coordinator"):  # shard-1 stays dead: not deployment.check_alive
            deployment.start(name, *role_args(name))
            process = deployment.processes[name]
            wait_serving(address_of(deployment.config, name), partial(_alive, name, process))

    def lose(deployment: Deployment) -> None:
        _sigkill_shard_1(deployment)
        restarted.append(threading.Thread(target=kill_and_restart, args=(deployment,)))
        restarted[0].start()

    # Execute
    run = _train_losing_shard_1(tmp_path, "sync", lose, prefixes={"coordinator": DYING_COORDINATOR})
    restarted[0].join(HANG_S)

    # Assert: the restarted coordinator went on with the saved ring (not the checkpoint's
    # older one) and had the round's moved blocks pushed again: every round applied with
    # exactly the acknowledged clients
    assert run.log.count(f"{KILLED} declared gone") == 1, run.log[-4000:]
    _assert_moved_on(run, "killed, with the coordinator and the key holder", timed=False)


def test_key_holder_parties_decrypt_on_the_moved_ring_when_a_shard_is_lost(
    tmp_path: Path,
) -> None:
    # Prepare, Execute: key-holder parties (any 2 of 3 decrypt), three shards; shard-1 dies
    # (SIGKILL) right after it acknowledged client 0's push of round 2, for good
    run = _train_losing_shard_1(tmp_path, "sync", _sigkill_shard_1, parties=PARTIES)

    # Assert: the ring moved on without shard-1; every round was decrypted by the parties,
    # which fetched rounds 2 and 3 from shard-0 and shard-2 alone: the model is the plaintext
    # replay within the parties' flooding
    _assert_moved_on(run, "killed", within=lambda released: flooding_bound(run.config, released))
    state = run.config.cluster.state_dir
    paths = [party_folder(state, j) / LEDGER_FILE for j in range(1, PARTIES + 1)]
    ledgers = [path.read_bytes() for path in paths if path.exists()]  # a party not asked: none
    for round_ in range(1, ROUNDS + 1):  # decrypted by THRESHOLD parties each
        assert sum(f'"{round_}"'.encode() in ledger for ledger in ledgers) >= THRESHOLD


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_shard_cut_off_the_network_for_good_moves_its_blocks_and_loses_nothing(
    tmp_path: Path, mode: str
) -> None:
    # Prepare: shard-1 on its own "host" (a network namespace on a veth pair), the other
    # roles on an address of this host that the link's end does not carry
    with isolated_host() as host:
        ports = [free_port() for _ in range(4)]
        cluster: dict[str, object] = {
            "keyholder": f"{host.outside}:{ports[0]}",
            "coordinator": f"{host.outside}:{ports[1]}",
            "shards": [
                f"{host.outside}:{ports[2]}",
                f"{host.inside}:{free_port()}",
                f"{host.outside}:{ports[3]}",
            ],
        }

        # Execute: the link is deleted right after shard-1 acknowledged client 0's push of
        # round 2; the shard's process lives on, unreachable, and nothing reaches out of it
        run = _train_losing_shard_1(
            tmp_path, mode, lambda _: host.cut(), cluster, {KILLED: host.prefix}
        )

    # Assert: the ring moved on without shard-1, and nothing acknowledged was lost
    _assert_moved_on(run, "cut off")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_shard_proven_to_tamper_is_declared_gone_and_training_finishes(
    tmp_path: Path, mode: str
) -> None:
    # Prepare: three shards, one proof quarantines; shard-1's process hands over a tampered
    # sum in round 2 (tests.tampering_shard; async: the second buffer flush)
    config, path = cluster_config(
        tmp_path,
        rounds=ROUNDS,
        clients=CLIENTS,
        training=MODES[mode],
        cluster={"shards": [f"127.0.0.1:{free_port()}" for _ in range(3)]},
    )
    config = config.model_copy(
        update={"security": config.security.model_copy(update={"max_detections": 1})}
    )
    write_config(config, path)
    deployment = Deployment(path, config)
    deployment.prefixes[KILLED] = tampering_prefix(2)
    try:
        start_servers(deployment)
        clients = [RecordingClient.open(config, index=i, peer_wait_s=10.0) for i in range(CLIENTS)]

        # Execute
        run_clients(clients, timeout_s=HANG_S)
        final = wait_for_round(config, ROUNDS, finished=True)
        exported = exported_model(config)  # shard-1 still serves an older version: not read
    finally:
        log = (deployment.log_dir / "coordinator.log").read_text()
        deployment.stop()

    # Assert: round 2 refused on proof (nothing decrypted), shard-1 declared gone for it and
    # round 2 pushed again without it, then applied; every round applied with exactly the
    # acknowledged clients, equal to the plaintext replay
    assert f"{KILLED} declared gone (quarantined: the key holder proved it tampered)" in log, log
    assert f"round 2: {KILLED} is gone (quarantined on proof)" in log, log[-4000:]
    assert (final.ring_version, final.ring_nodes) == (1, ("shard-0", "shard-2"))
    assert [r.abandoned for r in final.history] == [False, False, False], log[-4000:]
    _, meta = keyholder_state(config.cluster.state_dir)
    assert set(meta["detections"]) == {KILLED}
    assert_replayed(config, final, recorded(clients), log[-4000:])
    assert_exported(config, exported)


def test_a_shard_lost_under_mutual_tls_moves_its_blocks_and_loses_nothing(tmp_path: Path) -> None:
    # Prepare: the default configuration (mutual TLS, every role and client its certificate),
    # three shards; the clients are processes (TLS is process-wide), this test the operator
    config = load_config(
        None,
        cluster={
            **local_cluster(tmp_path / "state", shards=3),
            "shard_gone_after_s": GONE_AFTER_S,
        },
        training={
            "rounds": ROUNDS,
            "clients": CLIENTS,
            "min_quorum": 2,
            "deadline_s": 300.0,
            "checkpoint_every": 1,
            "lr": 0.3,
        },
        security={"flood_bits": 0},
        tls={"directory": str(tmp_path / "certs")},
    )
    assert config.tls.enabled and not config.tls.insecure
    provision_cluster(config)
    path = tmp_path / "fedps.toml"
    write_config(config, path)
    setup_tls(config.tls, OPERATOR_NAME)
    deployment = Deployment(path, config)
    deployment.prefixes[KILLED] = dying_prefix(2)
    outs = [tmp_path / f"client-{i}-out" for i in range(CLIENTS)]
    clients: list[subprocess.Popen[bytes]] = []
    try:
        start_servers(deployment)
        for i, out in enumerate(outs):
            out.mkdir()
            with open(tmp_path / f"client-{i}.log", "ab") as output:
                command = [sys.executable, "-m", "tests.recording_client", str(path), str(i)]
                command += [str(tmp_path / f"client-{i}-state"), str(out)]
                clients.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT))

        # Execute: shard-1's process dies at the first push of round 2 it takes, before it
        # answers (tests.dying_shard: a kill from this process could land after the round
        # closed, a moment whose loss costs the round, not what this test is about)
        deployment.processes[KILLED].wait(HANG_S)
        final = wait_for_round(config, ROUNDS, finished=True)
        for client in clients:
            client.wait(HANG_S)
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(HANG_S)
        log = (deployment.log_dir / "coordinator.log").read_text()
        deployment.stop()

    # Assert: the ring moved on without shard-1 under mutual TLS, nothing acknowledged lost
    assert f"{KILLED} declared gone" in log, log[-4000:]
    assert (final.ring_version, final.ring_nodes) == (1, ("shard-0", "shard-2"))
    assert_replayed(config, final, [load_recorded(out) for out in outs], log[-4000:])
