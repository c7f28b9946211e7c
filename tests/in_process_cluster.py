"""A real fedps cluster on loopback in this process: key holder, shards and coordinator.

Without the client side (Opacus, the DP trainer): the fuzz's subprocess
(``tests/security/fuzz``) starts its cluster from here. Tests take these helpers from
``tests.conftest``, beside the fixtures.
"""

from __future__ import annotations

# isort: off
import fedps  # noqa: F401  # first: its import quiets gRPC core's logging before grpc loads

# isort: on
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from crypto.enrolment import issue_tokens
from crypto.tls import tls_identity
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import client_identities
from fedps.rpc.transport import bind, create_server
from server.coordinator.coordinator import Coordinator
from server.coordinator.round_record import OpenRound
from server.keyholder.keyholder import KeyHolder
from server.serve import add_coordinator, add_keyholder, add_shard
from server.shard.shard import Shard
from tests.waiting import wait_for

__all__ = [
    "Cluster",
    "commit_phase_over",
    "end_commit_phase_if",
    "end_commits_once_in",
    "start_cluster",
    "start_coordinator",
]


@dataclass
class Cluster:
    """Running servers plus the configuration that points at them."""

    config: FedPSConfig
    keyholder: KeyHolder
    shards: list[Shard]
    coordinator: Coordinator  # not started (None) when start_cluster(coordinator=False)
    servers: dict[str, grpc.Server]
    state_dir: Path

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        for server in self.servers.values():
            server.stop(grace=None)


def start_cluster(
    tmp_path: Path,
    *,
    num_shards: int = 2,
    coordinator: bool = True,
    **sections: Mapping[str, object],
) -> Cluster:
    """Bind every server on port 0, then build the roles from the bound addresses.

    The roles share this process, and mutual TLS is process-wide (one certificate for all of
    them), so the cluster runs explicitly without TLS: clients prove their identity with the
    enrolment tokens (``client-0`` ... ``client-{training.clients - 1}``) written into
    ``tmp_path / "certs"``, the configuration's ``tls.directory``.
    """
    if tls_identity() is not None:
        raise RuntimeError("start_cluster runs without TLS; a test left TLS configured")
    servers = {"keyholder": create_server(), "coordinator": create_server()}
    for i in range(num_shards):
        servers[f"shard-{i}"] = create_server()
    ports = {name: bind(server, "127.0.0.1:0") for name, server in servers.items()}
    cluster = {
        "keyholder": f"127.0.0.1:{ports['keyholder']}",
        "coordinator": f"127.0.0.1:{ports['coordinator']}",
        "shards": [f"127.0.0.1:{ports[f'shard-{i}']}" for i in range(num_shards)],
        "state_dir": str(tmp_path / "state"),
        **sections.pop("cluster", {}),  # more of it (key-holder parties' addresses)
    }
    tls = {"insecure": True, "directory": str(tmp_path / "certs"), **sections.pop("tls", {})}
    config = load_config(None, cluster=cluster, tls=tls, **sections)
    issue_tokens(config.tls.directory, client_identities(config))
    keyholder = add_keyholder(servers["keyholder"], config, tmp_path / "state" / "keyholder")
    shards = [add_shard(servers[f"shard-{i}"], config, i) for i in range(num_shards)]
    for name, server in servers.items():
        if name != "coordinator":
            server.start()
    coord: Coordinator | None = None
    if coordinator:
        coord = add_coordinator(servers["coordinator"], config, tmp_path / "state" / "coordinator")
        servers["coordinator"].start()
    return Cluster(config, keyholder, shards, coord, servers, tmp_path / "state")  # type: ignore[arg-type]


def start_coordinator(cluster: Cluster) -> Coordinator:
    """Start the coordinator of a cluster started with ``coordinator=False`` (its port is
    bound already): for tests whose clients take longer to build than the coordinator waits
    for them before its first round."""
    if cluster.coordinator is not None:
        raise RuntimeError("the cluster's coordinator is running already")
    server = cluster.servers["coordinator"]
    cluster.coordinator = add_coordinator(server, cluster.config, cluster.state_dir / "coordinator")
    server.start()
    return cluster.coordinator


def end_commits_once_in(coordinator: Coordinator, members: set[str], round_: int = 1) -> None:
    """Wait until each of ``members`` (client ids) has committed to round ``round_`` or said
    it has nothing to send, then end the round's commit phase as its deadline does: the
    deadline becomes now.

    For a test whose cohort holds a member that will never commit (killed, silent): the
    round then closes as it would at ``training.deadline_s``, but the test need not sit
    through a deadline chosen long enough for a loaded machine's clients (it can be a hang
    guard), and a slow machine cannot close the round before the others committed. Returns
    at once if the commit phase ended first (its deadline passed).
    """

    def everyone_in(opened: OpenRound) -> bool:
        return opened.round == round_ and members <= opened.committed | opened.reported

    wait_for(
        lambda: (
            end_commit_phase_if(coordinator, everyone_in) or commit_phase_over(coordinator, round_)
        ),
        f"{sorted(members)} in round {round_}",
    )


def end_commit_phase_if(coordinator: Coordinator, ready: Callable[[OpenRound], bool]) -> bool:
    """End the open round's commit phase as its deadline does (the deadline becomes now) if
    ``ready(open round)`` holds; ``ready`` is called holding the coordinator's lock.

    Returns whether it did: False while no round is in its commit phase, or ``ready`` is false.
    """
    with coordinator._changed:
        opened = coordinator.desk.open_round
        if opened is None or opened.pushing or not ready(opened):
            return False
        opened.deadline = time.time()
        coordinator._changed.notify_all()
        return True


def commit_phase_over(coordinator: Coordinator, round_: int) -> bool:
    """Whether round ``round_``'s commit phase is over: it pushes, or the round has ended."""
    opened = coordinator.desk.open_round
    if opened is not None and opened.round >= round_:
        return opened.pushing or opened.round > round_
    return coordinator.round >= round_
