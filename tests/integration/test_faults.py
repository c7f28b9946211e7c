"""The fault matrix: faults beyond clean crashes, on a cluster of real processes.

Key holder, two shards and the coordinator run as ``python -m fedps.cli ROLE`` processes;
three clients record the plaintext of what they pushed. Each case injects one fault: a write
that fails with ENOSPC (the write helper's test hook, ``FEDPS_INJECT_FAULTS``) in each role's
state, a torn log tail, a second instance of a shard, SIGTERM of every role mid-round, a
client SIGKILLed and restarted. Training must then finish with the key holder's model equal
to the plaintext replay of exactly the acknowledged updates: no acknowledged update lost, no
round abandoned, no wedge. A flipped bit in each state file, and a missing signing key, must
instead make the damaged role refuse to start with one line naming the file.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from fedps.config import FedPSConfig
from fedps.rpc.coordinator_messages import ClusterStatus
from fedps.runtime.deployment import Deployment
from tests.conftest import RecordingClient, run_clients
from tests.process_cluster import (
    HANG_S,
    assert_replayed,
    cluster_config,
    recorded,
    role_args,
    start_role,
    start_servers,
    wait_for_round,
)
from tests.recording_client import load_recorded
from tests.role_processes import last_line, run_fedps

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROUNDS = 3
CLIENTS = 3
SERVERS = ["keyholder", "shard-0", "shard-1", "coordinator"]
INJECT = "FEDPS_INJECT_FAULTS"

#: ENOSPC once in each role's state writes: ``{role: file pattern@which write fails}``
#: (round 1's key-holder state, round 1's first log record after the opening, round 1's
#: published model, the coordinator's checkpoint as round 1 closes)
ENOSPC = {
    "keyholder-state": {"keyholder": "keyholder-state.npz@2"},
    "shard-log": {"shard-0": "round-*.wal@2", "shard-1": "round-*.wal@2"},
    "shard-model": {"shard-0": "model.pb@2", "shard-1": "model.pb@2"},
    "coordinator-checkpoint": {"coordinator": "coordinator-checkpoint.npz@3"},
}


def _start_servers(deployment: Deployment, faults: dict[str, str]) -> None:
    """Every server role, each with its faults armed (``{role: pattern}``)."""
    start_servers(deployment, {name: {INJECT: pattern} for name, pattern in faults.items()})


def _train(
    config: FedPSConfig, clients: list[RecordingClient], during: Callable[[], None] | None = None
) -> ClusterStatus:
    """Run the clients to the end of training, with ``during`` in a thread beside them;
    returns the coordinator's final status."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            assert during is not None
            during()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target) if during is not None else None
    if thread is not None:
        thread.start()
    run_clients(clients, timeout_s=HANG_S)
    if thread is not None:
        thread.join(HANG_S)
    if errors:
        raise errors[0]
    return wait_for_round(config, ROUNDS, finished=True)


def _run(
    deployment: Deployment,
    *,
    faults: dict[str, str] | None = None,
    during: Callable[[], None] | None = None,
) -> tuple[ClusterStatus, list[RecordingClient]]:
    """Start the servers (``faults`` armed per role), train with every client and
    ``during`` beside them, stop the servers; the final status and the clients."""
    config = deployment.config
    try:
        _start_servers(deployment, faults or {})
        clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]
        return _train(config, clients, during), clients
    finally:
        deployment.stop()


@pytest.mark.parametrize("case", sorted(ENOSPC))
def test_a_failed_write_loses_nothing(tmp_path: Path, case: str) -> None:
    # Prepare: one write of one role's state fails with ENOSPC (half of it on disk)
    config, path = cluster_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    # Execute
    final, clients = _run(deployment, faults=ENOSPC[case])

    # Assert: the fault happened, and nothing was lost or counted twice
    logs = "".join((deployment.log_dir / f"{n}.log").read_text() for n in SERVERS)
    assert "No space left on device" in logs  # the fault happened (reported by a caller)
    assert_replayed(config, final, recorded(clients), logs[-4000:])


def test_a_torn_log_tail_is_cut_and_nothing_acknowledged_is_lost(tmp_path: Path) -> None:
    # Prepare: shard-0 dies (SIGKILL) after round 1 while a record is half written: its log
    # ends in a record whose length reaches past the end of the file
    config, path = cluster_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    log_dir = config.cluster.state_dir / "shard-0" / "log"

    def tear() -> None:
        wait_for_round(config, 1)
        proc = deployment.processes["shard-0"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(HANG_S)
        payload = bytes(1000)
        header = struct.pack("<II", len(payload), zlib.crc32(payload))
        with open(max(log_dir.glob("round-*.wal")), "ab") as fh:
            fh.write(header + payload[:500])  # the length reaches past the end of the file
        start_role(deployment, "shard-0")

    # Execute
    final, clients = _run(deployment, during=tear)

    # Assert
    shard_log = (deployment.log_dir / "shard-0.log").read_text()
    assert "torn last record" in shard_log
    assert_replayed(config, final, recorded(clients), shard_log[-4000:])


def test_a_second_shard_instance_exits_and_the_first_keeps_serving(tmp_path: Path) -> None:
    # Prepare
    config, path = cluster_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    second: list[subprocess.CompletedProcess[str]] = []

    def start_a_second_shard_0() -> None:
        wait_for_round(config, 1)
        second.append(run_fedps(*role_args("shard-0"), "--config", str(path), "--insecure"))

    # Execute
    final, clients = _run(deployment, during=start_a_second_shard_0)

    # Assert: the second exits 2 with one line; training went on with the first
    (result,) = second
    last = last_line(result.stderr)
    assert result.returncode == 2, result.stderr
    assert last.startswith("fedps: error:") and "shard-0" in last, result.stderr
    assert "Traceback" not in result.stderr
    assert_replayed(config, final, recorded(clients))


def test_sigterm_of_every_role_mid_round_loses_nothing(tmp_path: Path) -> None:
    # Prepare
    config, path = cluster_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    stopped: list[int | None] = []

    def stop_everything_and_restart() -> None:
        wait_for_round(config, 1)
        time.sleep(0.5)  # into round 2 (any moment will do)
        for name in reversed(SERVERS):
            deployment.processes[name].send_signal(signal.SIGTERM)
        for name in SERVERS:
            stopped.append(deployment.processes[name].wait(HANG_S))
        _start_servers(deployment, {})

    # Execute
    final, clients = _run(deployment, during=stop_everything_and_restart)

    # Assert: every role stopped gracefully (then ended by the signal), and nothing was lost
    assert stopped == [-signal.SIGTERM] * 4
    assert_replayed(config, final, recorded(clients))


def test_a_client_sigkilled_and_restarted_loses_nothing(tmp_path: Path) -> None:
    # Prepare: client 0 is a process that records what it pushes in files
    config, path = cluster_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    out = tmp_path / "client-0-out"
    out.mkdir()

    def client_process() -> subprocess.Popen[bytes]:
        log = open(tmp_path / "client-0.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "tests.recording_client", str(path), "0"]
        cmd += [str(tmp_path / "client-0-state"), str(out)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return proc

    try:
        _start_servers(deployment, {})
        others = [RecordingClient.open(config, index=i) for i in range(1, CLIENTS)]
        first = client_process()
        restarted: list[subprocess.Popen[bytes]] = []

        def kill_and_restart() -> None:
            wait_for_round(config, 1)
            first.send_signal(signal.SIGKILL)
            first.wait(HANG_S)
            restarted.append(client_process())

        # Execute
        final = _train(config, others, kill_and_restart)
        assert restarted[0].wait(HANG_S) == 0
    finally:
        deployment.stop()

    # Assert
    client_log = (tmp_path / "client-0.log").read_text()
    pushed = [load_recorded(out), *recorded(others)]
    assert_replayed(config, final, pushed, client_log[-4000:])


def _flip_bit(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


#: A flipped bit in each state file, a missing key: ``{case: (role, file in its state)}``
DAMAGE = {
    "keyholder-state": ("keyholder", "keyholder/keyholder-state.npz"),
    "signing-key-missing": ("keyholder", "keyholder/keys/signing.key"),
    "signing-key": ("keyholder", "keyholder/keys/signing.key"),  # raw bytes: its checksum tells
    "challenge-key": ("keyholder", "keyholder/keys/challenge.key"),
    "shard-model": ("shard-0", "shard-0/model.pb"),
    "shard-log": ("shard-0", "shard-0/log/round-*.wal"),
    "coordinator-checkpoint": ("coordinator", "coordinator/coordinator-checkpoint.npz"),
}


def test_a_damaged_state_file_stops_its_role_with_one_line(tmp_path: Path) -> None:
    # Prepare: a run that finished, every role stopped
    config, path = cluster_config(tmp_path, rounds=1, clients=CLIENTS)
    deployment = Deployment(path, config)
    try:
        _start_servers(deployment, {})
        run_clients([RecordingClient.open(config, index=i) for i in range(CLIENTS)], HANG_S)
        wait_for_round(config, 1, finished=True)
    finally:
        deployment.stop()
    state = config.cluster.state_dir
    refused: dict[str, tuple[int, str, str]] = {}
    for case, (role, pattern) in DAMAGE.items():
        (target,) = sorted(state.glob(pattern))[-1:]
        before = target.read_bytes()
        if case == "signing-key-missing":
            target.unlink()
        elif case == "shard-log":
            _flip_bit(target, 0.3)  # a middle record (the round's opening)
        else:
            _flip_bit(target)

        # Execute: start the damaged role
        result = run_fedps(*role_args(role), "--config", str(path), "--insecure")
        refused[case] = (result.returncode, result.stderr, target.name)
        target.write_bytes(before)  # the next case starts from a sound state

    # Assert: each refuses to start, with one line naming the file (no traceback)
    for case, (code, stderr, name) in refused.items():
        last = last_line(stderr)
        assert code == 2, (case, stderr)
        assert last.startswith("fedps: error:") and name in last, (case, stderr)
        assert "Traceback" not in stderr, (case, stderr)
