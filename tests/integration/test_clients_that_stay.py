"""Clients that stay: servers fail and come back, clients keep training; a dead client leaves
the cohort at once. Real servers on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clients.edge_client import ClientSummary, EdgeClient
from fedps.rpc.transport import bind, create_server
from server.serve import add_keyholder, add_shard
from tests.conftest import (
    Cluster,
    end_commits_once_in,
    run_clients,
    start_cluster,
    start_coordinator,
)
from tests.round_driver import TaskPoller

pytestmark = pytest.mark.integration

_HANG_S = 120.0  # generous: only catches a hang


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition`` holds (failing only on a hang)."""
    until = time.monotonic() + _HANG_S
    while not condition():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _stop_every_server(cluster: Cluster) -> None:
    """The whole cluster goes down: the coordinator's loop stops and every server cancels
    its calls in flight (what clients see of servers stopping)."""
    cluster.coordinator.stop()
    for server in cluster.servers.values():
        server.stop(grace=None)


def _start_every_server(cluster: Cluster) -> None:
    """The cluster comes back on the same addresses and state: key holder, shards, then
    the coordinator (which continues from its checkpoint)."""
    config, state = cluster.config, cluster.state_dir
    addresses = {"keyholder": config.cluster.keyholder, "coordinator": config.cluster.coordinator}
    addresses |= {f"shard-{i}": a for i, a in enumerate(config.cluster.shards)}
    servers = {name: create_server() for name in addresses}
    for name, server in servers.items():
        bind(server, addresses[name])
    cluster.keyholder = add_keyholder(servers["keyholder"], config, state / "keyholder")
    cluster.shards = [
        add_shard(servers[f"shard-{i}"], config, i) for i in range(len(config.cluster.shards))
    ]
    for name, server in servers.items():
        if name != "coordinator":
            server.start()
    cluster.servers = servers
    cluster.coordinator = None  # type: ignore[assignment]
    start_coordinator(cluster)


@pytest.mark.slow
def test_clients_train_on_through_a_full_cluster_restart(tmp_path: Path) -> None:
    # Prepare: four rounds, a checkpoint every round; two clients
    training = {"rounds": 4, "clients": 2, "min_quorum": 2, "checkpoint_every": 1}
    cluster = start_cluster(tmp_path, training=training)
    clients = [EdgeClient.open(cluster.config, index=i) for i in range(2)]
    restarted = threading.Event()
    first = cluster.coordinator

    def restart_after_the_first_round() -> None:
        _wait_for(lambda: len(first.history) >= 1, "the first round")
        _stop_every_server(cluster)
        time.sleep(3.0)  # every server is gone for a while
        _start_every_server(cluster)
        restarted.set()

    restarter = threading.Thread(target=restart_after_the_first_round, daemon=True)
    restarter.start()
    try:
        # Execute
        summaries = run_clients(clients, timeout_s=400)

        # Assert: the cluster came back and the same clients finished the run with it
        restarter.join(_HANG_S)
        assert restarted.is_set()
        coordinator = cluster.coordinator
        assert coordinator is not first and coordinator.finished
        assert coordinator.round == 4 and cluster.keyholder.version >= 2
        applied_after = [r for r in coordinator.history if r.round > 1 and not r.abandoned]
        assert applied_after, "no round was applied after the restart"
        for summary in summaries:
            assert isinstance(summary, ClientSummary) and summary.rounds_trained >= 2
    finally:
        cluster.stop()


@pytest.mark.slow
def test_clients_outlast_a_key_holder_whose_disk_is_full(tmp_path: Path) -> None:
    # Prepare: the key holder's commitments fail with a full disk (an OSError in the
    # handler: UNKNOWN at the client) three times, then the disk has room again
    cluster = start_cluster(
        tmp_path, training={"rounds": 2, "clients": 2, "min_quorum": 2, "deadline_s": 60.0}
    )
    board = cluster.keyholder.commits
    commit = board.commit
    failures: list[str] = []

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        if len(failures) < 3:
            failures.append("ENOSPC")
            raise OSError(28, "No space left on device")
        return commit(*args, **kwargs)

    board.commit = full_disk  # type: ignore[method-assign]
    try:
        # Execute
        summaries = run_clients([EdgeClient.open(cluster.config, index=i) for i in range(2)], 300)

        # Assert: no client died; every round was applied with both clients
        assert len(failures) == 3
        assert cluster.coordinator.finished
        assert [r.contributors for r in cluster.coordinator.history] == [2, 2]
        assert all(isinstance(s, ClientSummary) for s in summaries)
    finally:
        cluster.stop()


def test_a_cohort_member_that_never_reports_is_not_drawn_until_it_asks_again(
    tmp_path: Path,
) -> None:
    # Prepare: three registered clients that answer every TRAIN with an empty report, but
    # client-2 registers and is never heard from again. Round 1 ends as at its deadline once
    # the two others reported; round 2 waits its 5 s of grace for client-2 before drawing.
    training = {"rounds": 2, "clients": 3, "min_quorum": 2, "deadline_s": 5.0}
    cluster = start_cluster(tmp_path, coordinator=False, training=training)
    stop = threading.Event()
    try:
        coordinator = start_coordinator(cluster)
        size = coordinator.layout.num_params
        pollers = [TaskPoller(cluster.config, f"client-{i}", num_params=size) for i in range(3)]
        threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in pollers[:2]]
        for thread in threads:
            thread.start()

        # Execute: two rounds; then the silent client asks for a task
        end_commits_once_in(coordinator, {"client-0", "client-1"})
        _wait_for(lambda: coordinator.finished, "the run to finish")
        missing = "client-2" not in coordinator.registry.live()
        pollers[2].run(stop)  # one GetTask: DONE

        # Assert: drawn for round 1 (it was live), left out of round 2 (it missed round 1's
        # deadline), live again once it asked
        assert [r.cohort for r in coordinator.history] == [3, 2]
        assert missing
        assert "client-2" in coordinator.registry.live()
    finally:
        stop.set()
        cluster.stop()
