"""A run leaves nothing that another local user can read: every folder it creates is 0700 and
every file 0600, whatever the umask.

What a run keeps is what the protocol hides from everyone else: the key holder's commit logs
hold every client's sketches (linear equations in the round's secret challenge), beside its
keys, the shards' logs of ciphertexts, the coordinator's checkpoint and each client's privacy
ledger (docs/security.md, claim 18).
"""

from __future__ import annotations

import stat
from contextlib import ExitStack
from pathlib import Path

import pytest

from clients.edge_client import EdgeClient
from fedps.provisioning import issue_cluster_certificates
from fedps.runtime.deployment import Deployment, write_config
from fedps.storage.state_lock import StateLock
from tests.conftest import run_clients, start_cluster
from tests.waiting import HANG_S

pytestmark = pytest.mark.integration

_ROLES = ("keyholder", "shard-0", "coordinator")


def _shared(root: Path) -> list[str]:
    """``MODE PATH`` of ``root`` and everything under it that has a group or other bit."""
    found = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            found.append(f"{mode:04o} {path}")
    return found


def test_a_run_leaves_its_state_to_its_owner_alone(tmp_path: Path, loose_umask: None) -> None:
    # Prepare: no umask (every mode left is the one fedps chose); each role's state folder
    # locked first, as `fedps up`'s role processes do
    state, certs = tmp_path / "state", tmp_path / "certs"
    with ExitStack() as stack:
        for name in _ROLES:
            stack.enter_context(StateLock(state / name))
        cluster = start_cluster(
            tmp_path,
            num_shards=1,
            training={"rounds": 1, "clients": 2, "min_quorum": 2, "deadline_s": 60.0},
        )
        stack.callback(cluster.stop)
        config = cluster.config
        issue_cluster_certificates(config, certs)  # the CA and every party's certificate
        config_path = state / "fedps.toml"  # where `fedps.LocalCluster` writes it
        write_config(config, config_path)
        clients = [EdgeClient.open(config, index=i) for i in range(config.training.clients)]

        # Execute: one round, then the operator's `fedps status` (its log in STATE/logs)
        run_clients(clients)
        deployment = Deployment(config_path, config)
        deployment.start("status", "status")
        status_exit = deployment.processes["status"].wait(timeout=HANG_S)

    # Assert: the run wrote what the attack read, and nothing of it is shared
    assert cluster.coordinator.finished
    assert status_exit == 0, deployment.last_log_line("status")
    assert list((state / "keyholder" / "commits").glob("round-*.wal"))
    assert list((state / "shard-0" / "log").glob("round-*.wal"))
    assert (state / "clients" / "client-0" / "ledger.json").is_file()
    assert (state / "logs" / "status.log").is_file()
    assert (certs / "ca.key").is_file()
    shared = _shared(state) + _shared(certs)
    assert not shared, "readable by group or others:\n" + "\n".join(shared)
