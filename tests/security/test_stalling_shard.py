"""A stalling shard is named (issue 27): a shard that holds a call open past its deadline is
counted, and after ``security.max_shard_misses`` misses in a row the run stops with one line
that names it.

Before, a shard that held ``FetchAggregate`` open was given up on by the key holder after the
call's deadline as unavailable, never counted, and the coordinator asked ``ApplyRound`` again
forever; a shard that held ``OpenRound`` or ``CloseRound`` open was asked again forever by
the coordinator itself. One shard stopped every round and was never named. Here real servers
run on loopback with a short shard deadline (``security.shard_deadline_s``), and shard-1's
servicer holds one RPC open on an event that the test releases at its end; the honest shard
answers in milliseconds.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.edge_client import ClientSummary, EdgeClient
from fedps.dashboard import StatusCollector
from fedps.errors import PeerUnavailableError, ShardStalledError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_messages import ModelState
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.transport import bind, create_server
from fedps.runtime.cluster_status import print_status
from fedps.runtime.deployment import free_port
from server.coordinator.coordinator import Coordinator
from server.serve import add_coordinator
from server.shard.shard_servicer import ShardServicer
from tests.conftest import Cluster, start_cluster
from tests.round_driver import HandClient, RoundDriver
from tests.security.arena import PARAMS, RUN, VERSION
from tests.server.test_metrics import samples
from tests.waiting import wait_for

pytestmark = [pytest.mark.attack, pytest.mark.integration, pytest.mark.slow]

STALLER, HONEST = "shard-1", "shard-0"
#: Misses in a row after which the run stops, and each call's deadline: small, so the test
#: takes seconds; the honest shard answers these small calls in milliseconds.
MISSES, DEADLINE_S = 2, 2.0
SECURITY: dict[str, object] = {"max_shard_misses": MISSES, "shard_deadline_s": DEADLINE_S}
#: A hang guard, far above the half minute a test takes on a loaded machine.
_HANG_S = 240.0


class Stall:
    """shard-1's servicer holds ``rpc`` open (every call) until :meth:`stop`; :attr:`held`
    counts the calls it held. The other shard answers as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rpc: str) -> None:
        self.rpc = rpc
        self.held = 0
        self._release = threading.Event()
        self._lock = threading.Lock()
        original = getattr(ShardServicer, rpc)
        stall = self

        def method(self: ShardServicer, request: Any, context: grpc.ServicerContext) -> Any:
            if self.shard.shard_id == STALLER and not stall._release.is_set():
                with stall._lock:
                    stall.held += 1
                stall._release.wait()  # the caller gave up long before
            return original(self, request, context)

        monkeypatch.setattr(ShardServicer, rpc, method)

    def stop(self) -> None:
        """Release every held call; the shard answers from now on (it was restarted)."""
        self._release.set()


def _ask_until_refused(driver: RoundDriver, clients: list[HandClient]) -> ShardStalledError:
    """Ask the key holder to apply round 1 as the coordinator does (again after each
    unavailable answer) until it refuses the round; at most MISSES times."""
    for _ in range(MISSES):
        try:
            driver.apply(1, VERSION, clients)
        except PeerUnavailableError:
            continue
        except ShardStalledError as exc:
            return exc
    raise AssertionError(f"the key holder did not refuse the round after {MISSES} asks")


def _keyholder_and_shards(tmp_path: Path) -> Cluster:
    """The key holder and two shards (no coordinator: the test plays it), on loopback."""
    return start_cluster(
        tmp_path, coordinator=False, training={"clients": 3, "min_quorum": 2}, security=SECURITY
    )


def _closed_round(cluster: Cluster, *, seed: int) -> tuple[RoundDriver, list[HandClient]]:
    """Round 1 committed and pushed by three hand clients, closed; its driver and clients."""
    cluster.keyholder.initialize(np.zeros(PARAMS), version=VERSION)
    driver = RoundDriver(cluster.config, cluster.keyholder.keys.public, run_id=RUN)
    rng = np.random.default_rng(seed)
    clients = [
        HandClient(f"client-{i}", rng.uniform(-0.3, 0.3, PARAMS), version=VERSION) for i in range(3)
    ]
    driver.committed_round(1, VERSION, clients)
    return driver, clients


def test_the_key_holder_names_a_shard_that_holds_its_fetch_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a closed round whose aggregates shard-1 holds back
    stall = Stall(monkeypatch, "FetchAggregate")
    cluster = _keyholder_and_shards(tmp_path)
    try:
        driver, clients = _closed_round(cluster, seed=11)
        keyholder = KeyHolderStub(cluster.config.cluster.keyholder)

        # Execute: the coordinator's part, until the key holder names the shard
        refusal = _ask_until_refused(driver, clients)
        stalled = keyholder.get_model_state()
        # ... the operator restarts the shard, which answers again: the same round applies
        stall.stop()
        applied = driver.apply(1, VERSION, clients)
        after = keyholder.get_model_state()
        keyholder.close()
    finally:
        stall.stop()
        cluster.stop()

    # Assert: named after MISSES misses in a row, each call held once
    assert str(refusal).startswith(
        f"apply: {STALLER} missed its 2 s deadline {MISSES} times in a row (FetchAggregate); "
        "every round needs it: restart it or replace it (docs/operations.md)"
    )
    assert stall.held == MISSES
    assert (stalled.shard_misses, stalled.stalled) == ({STALLER: MISSES}, (STALLER,))
    # ... a miss is no tampering: nobody is suspected or quarantined
    assert (stalled.detections, stalled.quarantined) == ({}, ())
    # ... the round was refused for now, not for good: nothing was decrypted before
    assert stalled.version == VERSION and applied.version == VERSION + 1
    # ... the answer ends the run of misses; the total stays
    assert (after.shard_misses, after.stalled) == ({STALLER: MISSES}, ())


def test_the_key_holder_names_a_shard_that_refuses_its_publications(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a closed round; shard-1 refuses every publication of a new version (it answers
    # its status calls, so it is never declared gone: before, the round stayed applied and
    # unpublished, and the coordinator asked again forever, the shard named in no stop line)
    refusing = threading.Event()
    refusing.set()
    refused: list[int] = []
    publish = ShardServicer.Publish

    def refuse(self: ShardServicer, request: Any, context: grpc.ServicerContext) -> Any:
        if self.shard.shard_id == STALLER and refusing.is_set() and self.shard.version:
            refused.append(1)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not taking it")
        return publish(self, request, context)

    monkeypatch.setattr(ShardServicer, "Publish", refuse)
    cluster = _keyholder_and_shards(tmp_path)
    try:
        driver, clients = _closed_round(cluster, seed=12)

        # Execute: the coordinator's part (asked again after each unavailable answer), until
        # the key holder names the shard; then the shard is replaced and takes it
        refusal = _ask_until_refused(driver, clients)
        refusing.clear()
        applied = driver.apply(1, VERSION, clients)
        served = cluster.shards[1].version
    finally:
        cluster.stop()

    # Assert: named after MISSES refusals in a row; the round was applied once, and published
    # once the shard took it
    assert f"{STALLER} refused the publication of version {VERSION + 1} {MISSES} times" in str(
        refusal
    )
    assert len(refused) == MISSES
    assert applied.version == VERSION + 1 and served == VERSION + 1


class _Clients:
    """Real edge clients, each running in its own thread; what each returned or raised."""

    def __init__(self, clients: list[EdgeClient]) -> None:
        self.results: list[ClientSummary | BaseException | None] = [None] * len(clients)
        self.threads = [
            threading.Thread(target=self._run, args=(i, c), daemon=True)
            for i, c in enumerate(clients)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, client: EdgeClient) -> None:
        try:
            self.results[index] = client.run(timeout_s=_HANG_S)
        except BaseException as exc:  # kept for the assertion
            self.results[index] = exc

    def exited(self) -> list[int]:
        return [i for i, t in enumerate(self.threads) if not t.is_alive()]

    def join(self) -> list[ClientSummary | BaseException | None]:
        for thread in self.threads:
            thread.join(_HANG_S)
        assert not any(t.is_alive() for t in self.threads), "hang guard: a client never ended"
        return self.results


def _restart_coordinator(cluster: Cluster) -> Coordinator:
    """The operator restarts the coordinator: same address and state folder (its metrics
    off: the old endpoint holds their port)."""
    cluster.coordinator.stop()
    cluster.servers["coordinator"].stop(grace=None).wait()
    metrics = cluster.config.metrics.model_copy(update={"coordinator": ""})
    config = cluster.config.model_copy(update={"metrics": metrics})
    server = create_server()
    bind(server, config.cluster.coordinator)
    cluster.coordinator = add_coordinator(server, config, cluster.state_dir / "coordinator")
    cluster.servers["coordinator"] = server
    server.start()
    return cluster.coordinator


def _scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as reply:
        return samples(reply.read().decode())


def _stop_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("the run stops:")]


@pytest.mark.parametrize(
    ("rpc", "counter"),
    [("FetchAggregate", "keyholder"), ("CloseRound", "coordinator")],
)
def test_a_stalling_shard_stops_the_run_with_one_line_that_names_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    rpc: str,
    counter: str,
) -> None:
    # Prepare: shard-1 holds `rpc` open (the key holder's fetch, or the coordinator's close);
    # two real clients, both needed by every round
    stall = Stall(monkeypatch, rpc)
    metrics = {r: f"127.0.0.1:{free_port()}" for r in ("keyholder", "coordinator")}
    training = {
        "rounds": 2,
        "clients": 2,
        "min_quorum": 2,
        "deadline_s": 60.0,
        "eval_every": 1000,
        "checkpoint_every": 1000,
    }
    cluster = start_cluster(tmp_path, training=training, security=SECURITY, metrics=metrics)
    try:
        with caplog.at_level(logging.INFO, logger="fedps"):
            # Execute: the clients train and push round 1; shard-1 stalls it
            clients = _Clients([EdgeClient.open(cluster.config, index=i) for i in range(2)])
            wait_for(lambda: bool(_stop_lines(caplog)), "the run to stop", hang_s=_HANG_S)
            exited = clients.exited()
            print_status(cluster.config)
            snapshot = StatusCollector(cluster.config).poll_once()
            status = CoordinatorStub(cluster.config.cluster.coordinator).get_status()
            state = KeyHolderStub(cluster.config.cluster.keyholder).get_model_state()
            scraped = _scrape(metrics[counter])
            history = list(cluster.coordinator.history)
            held = stall.held
            # ... the operator does what the line says: restarts the shard (it answers
            # again), then the coordinator, which continues the round it stopped in
            stall.stop()
            restarted = _restart_coordinator(cluster)
            results = clients.join()
    finally:
        stall.stop()
        cluster.stop()

    # Assert: one line an operator can act on, naming the stalling shard and the call
    lines = _stop_lines(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    line = lines[0].getMessage()
    assert f"{STALLER} missed its 2 s deadline {MISSES} times in a row ({rpc})" in line
    assert line.endswith("every round needs it: restart it or replace it (docs/operations.md)")
    assert HONEST not in line
    # ... the run stopped asking: the shard was asked exactly MISSES times
    assert held == MISSES
    assert history == [] and status.version == state.version == 0  # nothing applied
    # ... counted where the operator looks: status, metrics, `fedps status`, the dashboard
    misses = state.shard_misses if counter == "keyholder" else status.shard_misses
    stalled = state.stalled if counter == "keyholder" else status.stalled
    assert (misses.get(STALLER), stalled) == (MISSES, (STALLER,))
    labels = (("call", rpc), ("shard", STALLER))
    assert scraped[("fedps_shard_misses_total", labels)] == MISSES
    shown = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert f"STALLED: {MISSES} missed deadline(s)" in shown[STALLER]
    by_id = {s["id"]: s for s in snapshot["shards"]}
    assert by_id[STALLER]["misses"] == MISSES and by_id[STALLER]["stalled"] is True
    assert by_id[HONEST]["stalled"] is False
    # ... the honest shard is never blamed, and a miss is no tampering
    assert _no_blame(state)
    assert "SUSPECT" not in shown[HONEST] and "STALLED" not in shown[HONEST]
    # ... no client exited; after the restarts the stalled round was applied, not lost, and
    # the run finished with both clients
    assert exited == []
    assert all(isinstance(r, ClientSummary) for r in results), results
    assert restarted.finished
    assert [(r.round, r.abandoned, r.contributors) for r in restarted.history] == [
        (1, False, 2),
        (2, False, 2),
    ]


def _no_blame(state: ModelState) -> bool:
    """No detection and no quarantine at the key holder."""
    return not state.detections and not state.quarantined and not state.detection_reasons
