"""A round the key holder applies is applied once, durably, and published until every shard
has it, whatever write fails on the way (real servers, the write helper's ENOSPC hook).

Before: a failed write of the key holder's state left it at version v+1 in memory and v on
disk, and a shard that could not save the published model left the key holder at v+1 and the
shard at v; the coordinator took either error for a refusal, discarded the round, and every
later round was refused ("round 3 trained version 1, the model is at 2").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from crypto.files import FAULTS_VARIABLE
from fedps.errors import PeerUnavailableError
from fedps.proto import keyholder_pb2
from tests.conftest import Cluster
from tests.process_cluster import keyholder_state
from tests.round_driver import HandClient, RoundDriver, driven_cluster

pytestmark = pytest.mark.integration

RUN = "faults-run"
PARAMS = 3000


@pytest.fixture
def ready(tmp_path: Path) -> Iterator[tuple[Cluster, RoundDriver]]:
    with driven_cluster(tmp_path, num_shards=2, num_params=PARAMS, run_id=RUN) as ready:
        yield ready


def _clients() -> list[HandClient]:
    return [HandClient(c, np.full(PARAMS, 0.1 * (i + 1))) for i, c in enumerate("abc")]


def _apply(driver: RoundDriver, clients: list[HandClient]) -> keyholder_pb2.ApplyRoundReply:
    """Round 1 applied through the RPC (its UNAVAILABLE answers retried, as gRPC's retry
    policy and the coordinator do)."""
    return driver.apply(1, 0, clients)


def _apply_once(cluster: Cluster, clients: list[HandClient]) -> None:
    """One attempt at the key holder's handler (the first answer, before any retry)."""
    members = {c.client_id: c.signer.public_key for c in clients}
    cluster.keyholder.apply_round(1, 0, RUN, members)


def _saved_version(cluster: Cluster) -> int:
    """The version in the key holder's state file (what a restart loads)."""
    return int(keyholder_state(cluster.state_dir)[1]["version"])


def test_a_state_write_that_fails_applies_nothing_and_asking_again_applies_once(
    ready: tuple[Cluster, RoundDriver], faults: pytest.MonkeyPatch
) -> None:
    # Prepare: a committed round; the key holder's next state write fails (disk full)
    cluster, driver = ready
    clients = _clients()
    driver.committed_round(1, 0, clients)
    faults.setenv(FAULTS_VARIABLE, "keyholder-state.npz")

    # Execute: UNAVAILABLE, which the caller asks again (no refusal)
    with pytest.raises(PeerUnavailableError, match="round 1 is not applied"):
        _apply_once(cluster, clients)
    before = (cluster.keyholder.version, cluster.keyholder.last_round)
    result = _apply(driver, clients)

    # Assert: the failure changed nothing; the retry applied the mean once, durably
    assert before == (0, 0)
    assert result.version == 1
    np.testing.assert_allclose(cluster.keyholder.params, 0.2, atol=1e-3)  # type: ignore[arg-type]
    assert _saved_version(cluster) == 1
    assert {s.version for s in cluster.shards} == {1}


def test_a_version_a_shard_did_not_take_is_published_when_asked_again(
    ready: tuple[Cluster, RoundDriver], faults: pytest.MonkeyPatch
) -> None:
    # Prepare: a committed round; the next writes of a published model fail, more of them
    # than the channel's own retries (the shard answers each with UNAVAILABLE; 5 attempts) on
    # one shard at least, whichever order the shards, published at once, write in: 2 x 5 - 1
    cluster, driver = ready
    clients = _clients()
    driver.committed_round(1, 0, clients)
    faults.setenv(FAULTS_VARIABLE, ",".join(f"model.pb@{n}" for n in range(1, 10)))

    # Execute
    with pytest.raises(PeerUnavailableError, match="round 1 is applied") as refused:
        _apply_once(cluster, clients)
    versions = sorted(s.version for s in cluster.shards)
    on_disk = _saved_version(cluster)
    again = _apply(driver, clients)
    repeat = _apply(driver, clients)

    # Assert: applied and durable at once, a shard behind; asking again published it
    # and returned the same released result, never a fresh decryption
    assert "not yet published" in str(refused.value)
    assert versions[0] == 0 and on_disk == 1
    assert again.version == 1 and again == repeat
    assert {s.version for s in cluster.shards} == {1}
    np.testing.assert_allclose(cluster.keyholder.params, 0.2, atol=1e-3)  # type: ignore[arg-type]
