"""A client SIGKILLed mid-run and restarted keeps its id, its key and its privacy budget.

The client is a real ``fedps client`` process against a real cluster (key holder, two shards,
coordinator on loopback). Its own configuration calibrates its DP-SGD noise for a budget of
``BUDGET_ROUNDS`` rounds at ``TARGET_EPSILON``; the run would go on for many more. It is
killed with SIGKILL while it trains its second round, then started again on the same state
folder. A restarted client used to come back with a new key and accountant and train its data
again from epsilon 0.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from clients.client_state import LEDGER_FILE
from clients.edge_client import EdgeClient
from fedps.runtime.deployment import write_config
from server.coordinator.coordinator import Coordinator
from tests.conftest import run_clients, start_cluster
from tests.waiting import HANG_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.privacy]

BUDGET_ROUNDS = 3  # what the client's noise is calibrated for
RUN_ROUNDS = 30  # what the coordinator would run
TARGET_EPSILON = 3.0
CLIENT = "client-0"


def _ledger(path: Path) -> tuple[int, float] | None:
    """(DP-SGD steps, epsilon) of the client's one ledger entry; None before its first."""
    try:
        entries = json.loads(path.read_text())["entries"]
    except FileNotFoundError:
        return None
    if not entries:
        return None
    (entry,) = entries
    return sum(int(n) for _, _, n in entry["history"]), float(entry["epsilon"])


class _Watcher(threading.Thread):
    """Samples the client's epsilon every 10 ms, as the coordinator and the ledger hold it."""

    def __init__(self, coordinator: Coordinator, ledger: Path) -> None:
        super().__init__(daemon=True)
        self.coordinator = coordinator
        self.ledger = ledger
        self.at_coordinator: list[float] = []
        self.in_ledger: list[tuple[int, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            epsilon = self.coordinator.client_epsilons.get(CLIENT)
            if epsilon is not None:
                self.at_coordinator.append(epsilon)
            entry = _ledger(self.ledger)
            if entry is not None:
                self.in_ledger.append(entry)
            time.sleep(0.01)


def _start_client(config: Path, state_dir: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    command = ["client", "--index", "0", "--config", str(config), "--state-dir", str(state_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "fedps.cli", *command], stdout=log, stderr=subprocess.STDOUT
    )


def _non_decreasing(values: list[float]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(values))


def test_client_sigkilled_mid_run_keeps_its_id_and_never_trains_past_its_budget(
    tmp_path: Path,
) -> None:
    # Prepare: the cluster's run is RUN_ROUNDS long; the client's own configuration gives it
    # a budget of BUDGET_ROUNDS rounds
    cluster = start_cluster(
        tmp_path,
        training={"rounds": RUN_ROUNDS, "clients": 1, "min_quorum": 1, "deadline_s": 10.0},
        privacy={"target_epsilon": TARGET_EPSILON},
    )
    coordinator = cluster.coordinator
    training = cluster.config.training.model_copy(update={"rounds": BUDGET_ROUNDS})
    config = tmp_path / "client.toml"
    write_config(cluster.config.model_copy(update={"training": training}), config)
    state_dir = tmp_path / "client-state"
    ledger = state_dir / LEDGER_FILE
    log_path = tmp_path / "client.log"
    watcher = _Watcher(coordinator, ledger)
    watcher.start()
    try:
        with open(log_path, "ab") as log:
            client = _start_client(config, state_dir, log)
            wait_for(lambda: _ledger(ledger) is not None, "the first recorded round")
            first = _ledger(ledger)
            assert first is not None
            steps_per_round = first[0]

            # Execute: SIGKILL it once it recorded its second round (it is training it) ...
            wait_for(
                lambda: (_ledger(ledger) or (0, 0.0))[0] >= 2 * steps_per_round,
                "the second recorded round",
            )
            key = coordinator.clients[CLIENT].signing_key
            credential = coordinator.clients[CLIENT].credential_hash
            client.send_signal(signal.SIGKILL)
            killed = client.wait(HANG_S)
            at_kill = _ledger(ledger)
            run_finished_at_kill = coordinator.finished
            # ... and start it again on the same state folder
            restarted = _start_client(config, state_dir, log)
            wait_for(
                lambda: coordinator.clients[CLIENT].credential_hash != credential,
                "the restarted client's registration",
            )
            at_registration = coordinator.client_epsilons[CLIENT]
            key_after_restart = coordinator.clients[CLIENT].signing_key
            exit_code = restarted.wait(HANG_S)
    finally:
        watcher.done.set()
        watcher.join()
        cluster.stop()
    output = log_path.read_text(errors="replace")
    final = _ledger(ledger)

    # Assert: killed mid-run, restarted under the same client id with the same signing key
    assert killed == -signal.SIGKILL
    assert not run_finished_at_kill
    assert set(coordinator.clients) == {CLIENT}
    assert key_after_restart == key
    assert "resumes its privacy budget" in output, output[-3000:]
    # Its epsilon never goes down: not in its ledger, not at the coordinator, which heard the
    # spend of the round it died in (at registration at the latest)
    assert at_kill is not None and final is not None
    assert _non_decreasing([e for _, e in watcher.in_ledger])
    assert _non_decreasing(watcher.at_coordinator)
    assert at_registration >= at_kill[1]
    # It refuses to train past its target: BUDGET_ROUNDS rounds spent in all, the round it
    # was killed in included; then it said its budget is spent and stopped
    assert final[0] == BUDGET_ROUNDS * steps_per_round, output[-3000:]
    assert at_kill[1] < final[1] <= TARGET_EPSILON
    assert exit_code == 0, output[-3000:]
    assert coordinator.clients[CLIENT].exhausted
    # The coordinator's figure is what the data spent
    assert coordinator.client_epsilons[CLIENT] == final[1]
    assert coordinator.max_epsilon[0] == final[1]


def test_a_client_restarted_after_committing_lets_its_round_close_without_it(
    tmp_path: Path,
) -> None:
    # Prepare: two clients, one round; its deadline is far past the hang guard, so only the
    # restarted client's report can close the round before the guard fails the test
    cluster = start_cluster(
        tmp_path,
        training={"rounds": 1, "clients": 2, "min_quorum": 1, "deadline_s": 10 * HANG_S},
    )
    try:
        other = EdgeClient.open(cluster.config, index=1, state_dir=tmp_path / "client-1")
        assert other.session.start(time.time() + HANG_S)
        lost = EdgeClient.open(cluster.config, index=0, state_dir=tmp_path / "client-0")
        assert lost.session.start(time.time() + HANG_S)
        task = lost.session.next_train_task(0, HANG_S)
        assert task is not None
        outcome = lost.train_round(
            task.round, task.version, weight_scale=task.weight_scale, context_id=task.context_id
        )
        assert outcome.prepared is not None  # committed at the key holder, never pushed
        lost.session.shutdown()  # the process dies: what it committed is gone with it
        lost.close()
        others: list[object] = []
        trains = threading.Thread(target=lambda: others.extend(run_clients([other])))
        trains.start()
        desk = cluster.coordinator.desk
        wait_for(
            lambda: desk.open_round is not None and desk.open_round.pushing,
            "the round's push phase (the other client committed)",
        )

        # Execute: the client starts again once the round takes pushes
        restarted = EdgeClient.open(cluster.config, index=0, state_dir=tmp_path / "client-0")
        summaries = [*run_clients([restarted])]
        trains.join(HANG_S)
        history = cluster.coordinator.history
    finally:
        cluster.stop()

    # Assert: the round closed with the other client's update alone, nothing trained twice
    assert [(r.round, r.contributors, r.abandoned) for r in history] == [(1, 1, False)]
    assert [s.rounds_trained for s in [*others, *summaries]] == [1, 0]  # type: ignore[attr-defined]
