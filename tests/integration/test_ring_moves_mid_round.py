"""The ring moves while a round is in its push phase: real servers on loopback.

The operator removes a shard (``fedps shard --remove``) after a client's push to it was
acknowledged and before the round closes. The round must go on on the moved ring, as for a
shard declared gone: the clients push the moved blocks to their new owners, the key holder
applies the round with exactly the acknowledged clients, and training finishes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fedps.rpc.coordinator_stub import CoordinatorStub
from tests.conftest import RecordingClient, run_clients, start_cluster
from tests.process_cluster import assert_replayed, recorded, wait_for_round

pytestmark = [pytest.mark.integration, pytest.mark.attack]

_TRAINING = {"rounds": 2, "clients": 2, "min_quorum": 2, "deadline_s": 30.0, "lr": 0.3}


def test_a_shard_removed_mid_push_phase_moves_the_round(tmp_path: Path) -> None:
    # Prepare: three shards; client-0's acknowledgement by shard-1 in round 1 removes shard-1
    cluster = start_cluster(tmp_path, num_shards=3, training=_TRAINING, security={"flood_bits": 0})
    operator = CoordinatorStub(cluster.config.cluster.coordinator)
    removed = threading.Event()
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(2)]
        acknowledged = clients[0].pusher.on_acknowledged
        assert acknowledged is not None

        def remove_on_ack(round_: int, sid: str) -> None:
            acknowledged(round_, sid)
            if round_ == 1 and sid == "shard-1" and not removed.is_set():
                operator.remove_shard("shard-1")  # before client-0 reports: the round is open
                removed.set()

        clients[0].pusher.on_acknowledged = remove_on_ack

        # Execute
        run_clients(clients)
        final = wait_for_round(cluster.config, 2, finished=True)

        # Assert: shard-1 was removed mid-round, and every round applied on the moved ring
        assert removed.is_set()
        assert (final.ring_version, final.ring_nodes) == (1, ("shard-0", "shard-2"))
        assert not any(r.abandoned for r in final.history)
        assert_replayed(cluster.config, final, recorded(clients))
    finally:
        operator.close()
        cluster.stop()
