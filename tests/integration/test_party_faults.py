"""Key-holder parties that go down mid-run, as real processes: P = 3, T = 2.

The parties, the key holder (their combiner), two shards and the coordinator are processes;
three clients train in threads. Killing one party leaves the run training; killing a second
stops the rounds with one line naming the parties that are down (in the coordinator's log, and
in ``fedps status``), and the run resumes once one of them is back, from its state folder.
Killing the combiner (the key holder) and starting it again finishes the run too.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from crypto.files import read_checked
from fedps.runtime.deployment import Deployment
from server.keyholder.keyholder_party import LEDGER_FILE
from server.keyholder.party_process import party_folder
from tests.conftest import RecordingClient, run_clients
from tests.party_processes import party_config, start_party
from tests.process_cluster import start_role, status, wait_for_round
from tests.role_processes import run_fedps
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

ROUNDS, CLIENTS = 4, 3
DOWN_LINE = "1 of 3 key-holder parties answer, 2 must; down: party 2, party 3"
STATUS_LINE = "1 of 3 key-holder parties up, 2 must decrypt; down: party 2, party 3"


def test_one_party_down_trains_two_down_wait_with_a_line_and_one_back_resumes(
    tmp_path: Path,
) -> None:
    # Prepare
    config, path = party_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    logs = deployment.log_dir
    seen: dict[str, str] = {}
    counts: dict[str, int] = {}
    try:
        deployment.start_servers()
        clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]

        def faults() -> None:
            wait_for_round(config, 1)
            deployment.processes["party-3"].send_signal(signal.SIGKILL)
            counts["one down"] = len(status(config).history)
            wait_for_round(config, counts["one down"] + 1)
            deployment.processes["party-2"].send_signal(signal.SIGKILL)
            wait_for(lambda: DOWN_LINE in (logs / "coordinator.log").read_text(), "the line")
            counts["stalled"] = len(status(config).history)
            seen["status"] = run_fedps("status", "--config", str(path), "--insecure").stdout
            counts["later"] = len(status(config).history)
            start_party(deployment, 2)  # back, from its folder

        # Execute
        thread = threading.Thread(target=faults)
        thread.start()
        run_clients(clients)
        thread.join()
        final = wait_for_round(config, ROUNDS, finished=True)
    finally:
        deployment.stop()

    # Assert: every round applied (one down: trained on; two: waited, then resumed)
    assert final.finished and not any(r.abandoned for r in final.history)
    assert len(final.history) == ROUNDS
    assert counts["stalled"] == counts["later"]  # no round finished with two parties down
    report = seen["status"]
    assert "party-2 " in report and "party-3 " in report and "DOWN" in report, report
    assert (
        "rounds WAIT: 1 of 3 key-holder parties up, 2 must decrypt; down: party 2, party 3"
        in report
    )
    # party 2 came back from its folder (no new key generation) and decrypted the last round
    log = (logs / "party-2.log").read_text()
    assert log.count("key share read back") == 1
    ledger = (party_folder(config.cluster.state_dir, 2) / LEDGER_FILE).read_bytes()
    assert f'"{ROUNDS}"'.encode() in ledger


def test_the_combiner_killed_mid_run_and_restarted_finishes_the_run(tmp_path: Path) -> None:
    # Prepare
    config, path = party_config(tmp_path, rounds=ROUNDS, clients=CLIENTS)
    deployment = Deployment(path, config)
    logs = deployment.log_dir
    counts: dict[str, int] = {}
    try:
        deployment.start_servers()
        clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]

        def restart() -> None:
            wait_for_round(config, 1)
            deployment.processes["keyholder"].send_signal(signal.SIGKILL)
            counts["killed"] = len(status(config).history)
            start_role(deployment, "keyholder")  # its state folder, the joint context kept

        # Execute
        thread = threading.Thread(target=restart)
        thread.start()
        run_clients(clients)
        thread.join()
        final = wait_for_round(config, ROUNDS, finished=True)
    finally:
        deployment.stop()

    # Assert: every round applied once, none abandoned, after the restart too
    assert final.finished and not any(r.abandoned for r in final.history)
    assert len(final.history) == ROUNDS and counts["killed"] < ROUNDS
    # the parties kept their shares (no new key generation), and each round was decrypted
    # by two of them, for one aggregate (their ledgers)
    for j in (1, 2, 3):
        assert "key generation finished" in (logs / f"party-{j}.log").read_text()
    answered = [_ledger(party_folder(config.cluster.state_dir, j) / LEDGER_FILE) for j in (1, 2, 3)]
    for round_ in range(1, ROUNDS + 1):
        assert sum(str(round_) in ledger for ledger in answered) >= 2


def _ledger(path: Path) -> dict[str, object]:
    """A party's ledger: the rounds it answered for (none when it has none yet)."""
    data = read_checked(path, what="a party's ledger", hint="")
    return {} if data is None else dict(json.loads(data))
