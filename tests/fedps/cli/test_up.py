"""``fedps up`` on real processes: it supervises the roles until training ends.

The key holder, shards and coordinator are processes that ``fedps up`` starts; the clients are
:class:`EdgeClient` threads of this process (the cluster runs without TLS, clients prove who
they are with their enrolment tokens). Every wait is bounded only to catch a hang.

A run without faults, to the end (a line per round, the end said, exit 0), is the custom-task
example's (``tests/integration/test_custom_task.py``: ``fedps up`` under mutual TLS, clients
as processes); the runs here end with no role left behind after a fault or a SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clients.edge_client import EdgeClient
from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.storage.state_lock import StateLock
from tests.conftest import run_clients
from tests.processes_left import kill_left, marked_environment, processes_left
from tests.role_processes import (
    HANG_S,
    is_running,
    last_line,
    lock_holder,
    start_fedps,
    write_local_config,
)
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROUNDS = 3
CLIENTS = 3
ROLES = ["keyholder", "shard-0", "shard-1", "coordinator"]


@dataclass
class Up:
    """A running ``fedps up`` and the cluster it supervises."""

    proc: subprocess.Popen[bytes]
    config: FedPSConfig
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def role_pids(self) -> dict[str, int | None]:
        """The pid in each role's state lock (the process that holds, or last held, it)."""
        return {name: lock_holder(self.config.cluster.state_dir / name) for name in ROLES}

    def wait_up(self) -> dict[str, int]:
        """Wait until every role serves; return their pids."""
        wait_for(
            lambda: "fedps cluster up" in self.output or self.proc.poll() is not None,
            "up",
            hang_s=HANG_S,
            poll_s=0.2,
        )
        assert self.proc.poll() is None, self.output
        pids = self.role_pids()
        assert all(pid is not None for pid in pids.values()), pids
        return {name: pid for name, pid in pids.items() if pid is not None}

    def round_reached(self, round_: int) -> bool:
        coordinator = CoordinatorStub(self.config.cluster.coordinator)
        try:
            return coordinator.get_status(timeout_s=10).round >= round_
        except FedPSError:
            return False
        finally:
            coordinator.close()


def _write_config(root: Path) -> tuple[Path, FedPSConfig]:
    """A tiny training run: 3 rounds of 3 clients."""
    training = {
        "rounds": ROUNDS,
        "clients": CLIENTS,
        "min_quorum": 2,
        "deadline_s": 60.0,
        "checkpoint_every": 1,
        "lr": 0.3,
    }
    return write_local_config(root, training=training)


def _start_up(path: Path, config: FedPSConfig, log: Path) -> Up:
    return Up(start_fedps("up", str(path), "--insecure", log=log), config, log)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    """``fedps up`` on a tiny training run, stopped (SIGTERM) if a test left it running."""
    running = _start_up(*_write_config(tmp_path), log=tmp_path / "up.log")
    yield running
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)
        running.proc.wait(HANG_S)


def _train(up: Up) -> None:
    run_clients([EdgeClient.open(up.config, index=i) for i in range(CLIENTS)], timeout_s=HANG_S)


def _assert_no_role_left(up: Up, pids: dict[str, int]) -> None:
    """No role process is left, and every state directory can be locked again."""
    assert not [name for name, pid in pids.items() if is_running(pid)], pids
    for name in ROLES:
        with StateLock(up.config.cluster.state_dir / name) as lock:
            assert lock.held


def test_up_restarts_a_killed_shard_and_training_still_finishes(up: Up) -> None:
    # Prepare: training under way, its first round done
    pids = up.wait_up()
    clients = threading.Thread(target=_train, args=(up,))
    clients.start()
    wait_for(lambda: up.round_reached(1), "round 1", hang_s=HANG_S, poll_s=0.2)
    # Execute: SIGKILL shard-1
    os.kill(pids["shard-1"], signal.SIGKILL)
    clients.join(HANG_S)
    code = up.proc.wait(HANG_S)
    # Assert: restarted (logged with its exit code), a new process took its lock, training
    # finished and up exited 0
    output = up.output
    assert code == 0, output
    assert f"shard-1 exited with code {-signal.SIGKILL}" in output
    assert "restarting it" in output
    restarted = lock_holder(up.config.cluster.state_dir / "shard-1")
    assert restarted is not None and restarted != pids["shard-1"]
    assert f"training finished after {ROUNDS} rounds" in output
    _assert_no_role_left(up, {**pids, "shard-1": restarted})


def test_sigterm_stops_up_and_every_role(up: Up) -> None:
    # Prepare: the cluster up, its coordinator waiting for clients
    pids = up.wait_up()
    # Execute
    up.proc.send_signal(signal.SIGTERM)
    code = up.proc.wait(HANG_S)
    # Assert: a clean stop, ended by the signal it got; no role process left
    assert code == -signal.SIGTERM, up.output
    assert "stopping..." in up.output
    _assert_no_role_left(up, pids)


def test_sigkill_of_up_leaves_no_role_running(up: Up) -> None:
    # Prepare: the cluster up, its coordinator waiting for clients
    pids = up.wait_up()
    # Execute: up is killed outright (it can stop nothing itself)
    up.proc.kill()
    up.proc.wait(HANG_S)
    # Assert: each role saw its parent go and stopped, releasing its state folder
    wait_for(lambda: not any(is_running(pid) for pid in pids.values()), "every role stops")
    _assert_no_role_left(up, pids)


def test_a_role_on_a_port_in_use_stops_up_with_its_line(tmp_path: Path) -> None:
    # Prepare: another program listens on shard-1's port; up and all it starts are marked
    path, config = _write_config(tmp_path)
    host, _, port = config.cluster.shards[1].rpartition(":")
    env, mark = marked_environment()
    try:
        with socket.create_server((host, int(port))):
            # Execute
            log = tmp_path / "up.log"
            up = Up(start_fedps("up", str(path), "--insecure", log=log, env=env), config, log)
            code = up.proc.wait(HANG_S)
        # Assert: exit 2 with shard-1's one line; nothing restarted, nothing it started left
        # running (a role stopped before it took its state lock included)
        assert code == 2, up.output
        assert last_line(up.output) == (
            f"fedps: error: shard-1 stopped: {config.cluster.shards[1]} is in use (another "
            "fedps shard-1 may be running); stop it or choose another port"
        )
        assert "restarting" not in up.output
        assert processes_left(mark) == []
    finally:
        kill_left(mark)
