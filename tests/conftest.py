"""Shared fixtures: a real fedps cluster (key holder, shards, coordinator) on loopback."""

from __future__ import annotations

# isort: off
import fedps  # noqa: F401  # first: its import quiets gRPC core's logging before grpc loads

# isort: on
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from clients.edge_client import EdgeClient, PreparedPush
from crypto.enrolment import issue_tokens
from crypto.files import FAULTS_VARIABLE, reset_faults
from crypto.tls import tls_identity
from fedps.config import FedPSConfig, load_config
from fedps.errors import FedPSError
from fedps.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from fedps.provisioning import client_identities, reset_tls
from fedps.transport import bind, call, create_channel, create_server
from server.coordinator.coordinator import Coordinator
from server.keyholder.keyholder import KeyHolder
from server.serve import add_coordinator, add_keyholder, add_shard
from server.shard.shard import Shard
from tests.waiting import HANG_S, wait_for

# Hypothesis checks a fixed number of examples, never a pace: its per-example deadline
# (200 ms) and its "too slow" health check would fail a property on a loaded machine.
settings.register_profile("fedps", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fedps")


@pytest.fixture(autouse=True)
def _plaintext_after_each_test() -> Iterator[None]:
    """TLS is process-wide: whatever identity a test configured, the next test starts
    without one (in-process clusters cannot give each role its own certificate)."""
    yield
    reset_tls()


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """No umask while the test runs (new files 0666, folders 0777 unless fedps says
    otherwise): whatever fedps keeps must be its owner's alone (0600, 0700) regardless."""
    previous = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def one_ray_node() -> Iterator[None]:
    """The machine's only Ray node while the test runs: two started at once (by two test
    workers) time out waiting for each other's GCS start, so Ray tests take turns."""
    with open(Path(tempfile.gettempdir()) / "fedps-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Fault injection (:data:`crypto.files.FAULTS_VARIABLE`) armed afresh: the test sets the
    patterns with ``faults.setenv(FAULTS_VARIABLE, ...)``; they are gone after it."""
    reset_faults()
    yield monkeypatch
    monkeypatch.delenv(FAULTS_VARIABLE, raising=False)
    reset_faults()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first (in collection order, then the rest): with the test
    command's one-test-at-a-time scheduling (``-n 2 --maxschedchunk 1``) the long ones then
    share the workers instead of one of them ending the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


class RecordingClient(EdgeClient):
    """A real client that also keeps the plaintext of what it encrypted, for a replay, and
    the shards that acknowledged each round's push."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: dict[int, tuple[float, np.ndarray]] = {}
        self.pushed: dict[int, set[str]] = {}
        self.pusher.on_acknowledged = self.acknowledged_by

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        self.sent[round_] = (self.weight, delta.copy())
        return super().prepare(round_, version, delta)

    def acknowledged_by(self, round_: int, sid: str) -> None:
        """Shard ``sid`` acknowledged this client's push of round ``round_``."""
        self.pushed.setdefault(round_, set()).add(sid)

    @property
    def acknowledged(self) -> set[int]:
        """Rounds whose push every shard that owns a block acknowledged."""
        ring, layout = self.session.ring, self.session.layout  # known once the client joined
        owners = {ring.owner(b) for b in range(layout.num_blocks)}
        return {r for r, sids in self.pushed.items() if sids >= owners}


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


def end_commits_once_committed(coordinator: Coordinator, committed: set[str]) -> None:
    """Wait until ``committed`` (client ids) have all committed to the open round, then end
    its commit phase as its deadline does: the deadline becomes now.

    For a test whose cohort holds a member that will never commit (killed, silent): the
    round then closes as it would at ``training.deadline_s``, but the test need not sit
    through a deadline chosen long enough for a loaded machine's clients (it can be a hang
    guard), and a slow machine cannot close the round before the others committed.
    """

    def ready() -> bool:
        opened = coordinator._open
        return opened is not None and not opened.pushing and committed <= opened.committed

    wait_for(ready, f"{sorted(committed)} committed")
    with coordinator._changed:
        opened = coordinator._open
        assert opened is not None and not opened.pushing, "the commit phase ended already"
        opened.deadline = time.time()
        coordinator._changed.notify_all()


@pytest.fixture
def small_training() -> dict[str, object]:
    """A short, fast training section for integration tests."""
    return {"rounds": 2, "clients": 3, "min_quorum": 2, "deadline_s": 30.0, "lr": 0.3}


@pytest.fixture
def cluster(tmp_path: Path, small_training: dict[str, object]) -> Iterator[Cluster]:
    """A running cluster with 2 shards and a coordinator."""
    c = start_cluster(tmp_path, training=small_training)
    yield c
    c.stop()


def coordinator_status(address: str) -> coordinator_pb2.ClusterStatus | None:
    """The status of the coordinator at ``address``, or None while it does not answer (it
    is starting, restarting, or slow on a loaded machine): for tests that wait on it."""
    stub = coordinator_pb2_grpc.CoordinatorStub(create_channel(address))
    try:
        reply: coordinator_pb2.ClusterStatus = call(
            lambda: stub.GetStatus(common_pb2.Empty(), timeout=30), "status"
        )
    except FedPSError:
        return None
    return reply


def reached(address: str, round_: int = 0, *, finished: bool = False) -> bool:
    """Whether the coordinator at ``address`` answers with round ``round_`` or later (and
    with training over, if ``finished``)."""
    status = coordinator_status(address)
    return status is not None and status.round >= round_ and (status.finished or not finished)


def run_clients(clients: Sequence[object], timeout_s: float = HANG_S) -> list[object]:
    """Run ``EdgeClient.run`` for each client in its own thread; return the summaries.

    ``timeout_s`` is a hang guard, not a pace: a client still running after it fails the
    test. (``EdgeClient.run`` itself stops quietly when its ``timeout_s`` is spent, so a
    short one would change what a slow machine checks.)"""
    results: list[object] = [None] * len(clients)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = clients[i].run(timeout_s=timeout_s)  # type: ignore[attr-defined]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    until = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    if errors:
        raise errors[0]
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"hang guard: clients {stuck} still running after {timeout_s:g} s"
    return results
