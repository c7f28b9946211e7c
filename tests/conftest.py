"""Shared fixtures: a real fedps cluster (key holder, shards, coordinator) on loopback."""

from __future__ import annotations

# isort: off
import fedps  # noqa: F401  # first: its import quiets gRPC core's logging before grpc loads

# isort: on
import fcntl
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from clients.edge_client import EdgeClient, PreparedPush
from crypto.files import FAULTS_VARIABLE, reset_faults
from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from fedps.provisioning import reset_tls
from fedps.rpc.transport import call, create_channel
from tests.in_process_cluster import Cluster as Cluster
from tests.in_process_cluster import end_commits_once_in as end_commits_once_in
from tests.in_process_cluster import start_cluster as start_cluster
from tests.in_process_cluster import start_coordinator as start_coordinator
from tests.security.test_fuzz import SERVICES as FUZZ_SERVICES
from tests.waiting import HANG_S

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


@pytest.fixture(autouse=True)
def _no_user_modules_after_each_test(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A task a test imported from its temporary project (``task.dir`` joins ``sys.path``)
    is forgotten after it: the next test's project may have a module of the same name."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]


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


#: Each fuzz smoke run (200 inputs per RPC or path), the full run that starts with the same
#: inputs (tests/security/test_fuzz.py: one generator per RPC or path, seeded by its name), and
#: how many full tests that run takes (one per service for the RPCs).
_FUZZ_SMOKE = {
    "test_rpc_fuzz_smoke": ("test_rpc_fuzz", len(FUZZ_SERVICES)),
    "test_deser_fuzz_smoke": ("test_deser_fuzz", 1),
}


def _drop_fuzz_smoke(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A fuzz smoke run is left out when the whole of its full run is selected too: its
    inputs are the first of the full run's (the quick run, ``-m "not slow"``, keeps it)."""
    names = Counter(getattr(item, "originalname", item.name) for item in items)
    covered = {smoke for smoke, (full, count) in _FUZZ_SMOKE.items() if names[full] == count}
    dropped = [item for item in items if getattr(item, "originalname", item.name) in covered]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


@pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` chose the tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first (in collection order, then the rest): with the test
    command's one-test-at-a-time scheduling (``-n 4 --maxschedchunk 1``) the long ones then
    share the workers instead of one of them ending the run alone.

    The slow tests that take turns on the machine's one Ray node (:func:`one_ray_node`) are
    spread over the slow ones, the first at their start and the last at their end: side by
    side, two workers would each start one, and one would sit out the other's (half a
    minute and more)."""
    _drop_fuzz_smoke(config, items)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    turns = [item for item in slow if "one_ray_node" in getattr(item, "fixturenames", ())]
    if len(turns) > 1:
        order = [item for item in slow if item not in turns]
        gap = len(order) / (len(turns) - 1)
        for k in reversed(range(len(turns))):
            order.insert(round(k * gap), turns[k])
        items[: len(slow)] = order


class RecordingClient(EdgeClient):
    """A real client that also keeps the plaintext of what it encrypted, for a replay, its pad
    seeds, and the shards that acknowledged each round's push."""

    def __init__(self, config: FedPSConfig, **parts: Any) -> None:
        super().__init__(config, **parts)
        self.sent: dict[int, tuple[float, np.ndarray]] = {}
        self.pad_seeds: dict[int, bytes] = {}  # round -> its pad seed (crypto.blinding)
        self.pushed: dict[int, set[str]] = {}
        self.owners: dict[int, set[str]] = {}  # the shards owning a block on each round's ring
        self.pusher.on_acknowledged = self.acknowledged_by

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        self.sent[round_] = (self.weight, delta.copy())
        prepared = super().prepare(round_, version, delta)
        if prepared is not None and self.config.he.enabled:
            self.pad_seeds[prepared.round] = self.pipeline.challenge(prepared.round).pad_seed
        return prepared

    def acknowledged_by(self, round_: int, sid: str) -> None:
        """Shard ``sid`` acknowledged this client's push of round ``round_``.

        The round's owners are those of the ring the push went to last (a ring that moves
        mid-round has the blocks of a gone shard pushed again to their new owners).
        """
        self.pushed.setdefault(round_, set()).add(sid)
        ring, layout = self.session.ring, self.session.layout  # known once the client joined
        self.owners[round_] = {ring.owner(b) for b in range(layout.num_blocks)}

    @property
    def acknowledged(self) -> set[int]:
        """Rounds whose push every shard that owns a block acknowledged."""
        return {r for r, sids in self.pushed.items() if sids >= self.owners[r]}


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
