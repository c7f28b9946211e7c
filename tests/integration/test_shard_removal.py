"""The operator removes a shard between rounds (``fedps shard --remove``): real servers on loopback.

The coordinator moves the shard's blocks along the ring, the key holder publishes the model on
the new ring before the next round's clients pull it, and training goes on without the shard:
every round applied with exactly the acknowledged clients, equal to the plaintext replay.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedps.errors import InvalidArgumentError
from fedps.rpc.coordinator_stub import CoordinatorStub
from tests.conftest import RecordingClient, run_clients, start_cluster
from tests.process_cluster import assert_replayed, recorded, status, wait_for_round

pytestmark = pytest.mark.integration

_TRAINING = {"rounds": 2, "clients": 2, "min_quorum": 2, "deadline_s": 30.0, "lr": 0.3}


def test_a_shard_the_operator_removes_takes_no_more_pushes_and_loses_nothing(
    tmp_path: Path,
) -> None:
    # Prepare: three shards; the operator removes shard-1 before the clients start
    cluster = start_cluster(tmp_path, num_shards=3, training=_TRAINING, security={"flood_bits": 0})
    operator = CoordinatorStub(cluster.config.cluster.coordinator)
    try:
        operator.remove_shard("shard-1")
        with pytest.raises(InvalidArgumentError, match="not on the ring"):
            operator.remove_shard("shard-1")
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]

        # Execute
        run_clients(clients)
        final = wait_for_round(cluster.config, 2, finished=True)

        # Assert: the ring moved once, shard-1 took nothing, the others own every block
        assert (final.ring_version, final.ring_nodes) == (1, ("shard-0", "shard-2"))
        assert len(final.ring_moves) == 1 and "shard-1 removed" in final.ring_moves[0]
        assert cluster.shards[1].stats["accepted"] == 0
        owned = sorted(b for i in (0, 2) for b in cluster.shards[i].owned_blocks)
        assert owned == list(range(clients[0].session.layout.num_blocks))
        assert_replayed(cluster.config, final, recorded(clients))
        assert status(cluster.config).ring_version == 1
    finally:
        operator.close()
        cluster.stop()
