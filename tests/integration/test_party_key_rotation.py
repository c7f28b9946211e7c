"""Key rotation with key-holder parties, as real processes: a new collective key, adopted.

The parties, the key holder (their combiner), two shards and the coordinator are processes;
three clients train in threads. With ``security.rotate_every_rounds = 2`` the combiner asks
every party for a new collective key generation after rounds 2 and 4, serves the new joint
context once every party holds it, and each party replaces its share by the new one; the
clients encrypt under the new context from the next round on, and the run trains through.
Each party serves its own metrics.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from crypto import PublicContext
from crypto.threshold import KeyShare
from fedps.runtime.deployment import Deployment, free_port
from server.keyholder.joint_keys import JOINT_CONTEXT_FILE
from server.keyholder.party_key_generation import PUBLIC_CONTEXT_FILE, SHARE_FILE
from server.keyholder.party_process import party_folder
from server.keyholder.party_rotation import NEXT_DIR
from tests.conftest import RecordingClient, run_clients
from tests.party_processes import PARTIES, party_config
from tests.process_cluster import wait_for_round

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS, CLIENTS = 5, 3


def test_the_parties_rotate_the_joint_key_and_the_run_trains_through(tmp_path: Path) -> None:
    # Prepare
    metrics = [f"127.0.0.1:{free_port()}" for _ in range(PARTIES)]
    config, path = party_config(
        tmp_path,
        rounds=ROUNDS,
        clients=CLIENTS,
        security={"rotate_every_rounds": 2},
        metrics={"parties": metrics},
    )
    deployment = Deployment(path, config)
    logs = deployment.log_dir
    folders = [party_folder(config.cluster.state_dir, j) for j in range(1, PARTIES + 1)]
    try:
        deployment.start_servers()
        first = (folders[0] / PUBLIC_CONTEXT_FILE).read_bytes()
        shares = [KeyShare.load(f / SHARE_FILE).share.copy() for f in folders]
        clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]
        # Execute
        run_clients(clients)
        final = wait_for_round(config, ROUNDS, finished=True)
        pages = [_scrape(address) for address in metrics]
    finally:
        deployment.stop()

    # Assert: every round applied, none abandoned, across two rotations
    assert final.finished and not any(r.abandoned for r in final.history)
    assert len(final.history) == ROUNDS
    combiner = (logs / "keyholder.log").read_text()
    rotated = re.findall(r"rotated the parties' joint key after round (\d+)", combiner)
    assert rotated == ["2", "4"], combiner[-3000:]
    # the combiner serves what every party adopted, a new context; every share was replaced,
    # and nothing waits in next/
    served = (config.cluster.state_dir / "keyholder" / "keys" / JOINT_CONTEXT_FILE).read_bytes()
    assert served != first
    for j, folder in enumerate(folders, start=1):
        assert (folder / PUBLIC_CONTEXT_FILE).read_bytes() == served
        assert (KeyShare.load(folder / SHARE_FILE).share != shares[j - 1]).any()
        assert not list((folder / NEXT_DIR).glob("*"))
        assert (logs / f"party-{j}.log").read_text().count("adopted the rotated joint") == 2
    assert PublicContext.from_bytes(served).params == PublicContext.from_bytes(first).params
    # each party's own metrics: its share held, and two partials for every round in all
    assert all(page[("fedps_party_ready", ())] == 1.0 for page in pages)
    partials = (("kind", "partial"), ("outcome", "answered"), ("reason", ""))
    assert sum(page.get(("fedps_party_answers_total", partials), 0) for page in pages) >= 2 * ROUNDS


def _scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A party's metrics page, by sample name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
