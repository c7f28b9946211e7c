"""Asynchronous (FedBuff) aggregation with real servers: staleness-weighted, exact, bounded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.edge_client import EdgeClient
from fedps.errors import InvalidArgumentError
from fedps.learning.models import create_model
from fedps.learning.staleness import create_staleness, multiplier
from fedps.proto import shard_pb2, shard_pb2_grpc
from fedps.rpc.transport import create_channel
from fedps.sharding.blocks import group_mask
from server.keyholder.keyholder import RoundResult
from tests.conftest import Cluster, run_clients, start_cluster
from tests.round_driver import HandClient, RoundDriver
from tests.waiting import HANG_S, wait_for

pytestmark = pytest.mark.integration

RUN = "async-run"
PARAMS = 3000
ASYNC = {"mode": "async", "buffer_size": 3, "clients": 3, "min_quorum": 2, "max_staleness": 2}


@pytest.fixture
def async_cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tmp_path, num_shards=2, coordinator=False, training=ASYNC)
    yield cluster
    cluster.stop()


def _flush(
    cluster: Cluster,
    round_: int,
    version: int,
    updates: dict[str, np.ndarray],
    trained_on: dict[str, int],
) -> RoundResult:
    """One buffer of committed, encrypted updates through the real servers, then applied."""
    kh = cluster.keyholder
    driver = RoundDriver(cluster.config, kh.keys.public, run_id=RUN)
    clients = [HandClient(c, u, version=trained_on[c]) for c, u in updates.items()]
    driver.committed_round(round_, version, clients)
    return kh.apply_round(round_, version, RUN, {c.client_id: c.signer.public_key for c in clients})


def test_buffer_applies_the_staleness_weighted_fedbuff_average(async_cluster: Cluster) -> None:
    # Prepare: the model is at version 2; three updates trained on versions 2, 1 and 0
    kh = async_cluster.keyholder
    start = np.random.default_rng(0).normal(0, 0.1, PARAMS)
    kh.initialize(start, version=2, force=True)
    rng = np.random.default_rng(1)
    updates = {c: rng.uniform(-0.5, 0.5, PARAMS) for c in ("u0", "u1", "u2")}
    trained_on = {"u0": 2, "u1": 1, "u2": 0}  # staleness 0, 1, 2
    # Execute
    result = _flush(async_cluster, 1, 2, updates, trained_on)
    # Assert: x + sum(m_s u) / sum(m_s) with m_s = round(64 (1+s)^-0.5)
    fn = create_staleness("polynomial", a=0.5)
    m = {c: multiplier(fn, 2 - v) for c, v in trained_on.items()}
    assert sorted(m.values()) == [37, 45, 64]
    expected = start + sum(m[c] * updates[c] for c in updates) / sum(m.values())
    assert result.version == 3
    applied = kh.params
    assert applied is not None
    assert np.linalg.norm(applied - expected) / np.linalg.norm(expected) < 1e-4


def test_too_stale_update_is_refused_and_not_counted(async_cluster: Cluster) -> None:
    # Prepare: model at version 5, an update trained on version 2 (staleness 3 > 2)
    kh = async_cluster.keyholder
    kh.initialize(np.zeros(PARAMS), version=5, force=True)
    driver = RoundDriver(async_cluster.config, kh.keys.public, run_id=RUN)
    old = HandClient("old", np.ones(PARAMS), version=2)
    fresh = HandClient("fresh", np.ones(PARAMS), version=5)
    driver.open_commits(1, 5, [old, fresh])
    # Execute / Assert: the key holder refuses the stale commitment, takes the fresh one
    with pytest.raises(InvalidArgumentError, match=r"takes versions 3\.\.5"):
        driver.commit(1, old)
    driver.commit(1, fresh)
    assert driver.freeze(1).client_ids == ["fresh"]
    # ... and a shard opened with the stale client anyway refuses its push
    shard = async_cluster.shards[0]
    for s in async_cluster.shards:
        s.open_round(1, 5, {"old": old.signer.public_key}, kh.keys.public.context_id, RUN)
    stub = shard_pb2_grpc.ShardStub(create_channel(async_cluster.config.cluster.shards[0]))
    request = shard_pb2.PushRequest(
        client_id="old",
        round=1,
        version=2,
        weight=1.0,
        context_id=kh.keys.public.context_id,
        blocks=[
            shard_pb2.EncryptedBlock(block=b, ciphertext=old.sent[b]) for b in shard.owned_blocks
        ],
        nonce=old.signed.nonce,
        signature=old.signed.signature,
        roots=old.signed.roots,
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.PushBlocks(iter([request]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "maximum staleness" in (info.value.details() or "")
    assert shard.stats["accepted"] == 0
    assert shard.close_round(1) == []


def test_buffer_never_flushes_below_k_and_training_runs(tmp_path: Path) -> None:
    # Prepare: K = 3 of 3 clients; only two clients run at first
    cluster = start_cluster(tmp_path, training={**ASYNC, "rounds": 2, "max_staleness": 4})
    try:
        clients = [EdgeClient.open(cluster.config, index=i) for i in range(3)]
        early = threading.Thread(
            target=run_clients,
            args=(clients[:2],),
        )
        early.start()
        # (the event the check needs, not a pause: both early clients are in, and with two of
        # the three a buffer of K = 3 cannot fill)
        live = cluster.coordinator.registry.live
        wait_for(lambda: len(live()) == 2, "the two early clients checking in")
        # Assert: no flush with two updates
        assert cluster.keyholder.version == 0
        assert cluster.coordinator.history == []
        # Execute: the third client arrives; buffers flush
        run_clients(clients[2:])
        early.join(HANG_S)
        assert not early.is_alive(), "hang guard: the early clients never finished"
        # Assert
        assert cluster.coordinator.finished
        assert cluster.keyholder.version == 2
        assert all(r.contributors >= 3 for r in cluster.coordinator.history)
    finally:
        cluster.stop()


def _close(actual: np.ndarray, expected: np.ndarray) -> bool:
    return bool(np.linalg.norm(actual - expected) / np.linalg.norm(expected) < 1e-4)


def test_mixed_policy_sync_groups_change_only_at_round_close(tmp_path: Path) -> None:
    # Prepare: the digits MLP; its output layer ("2.*") synchronous, two flushes per round
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={**ASYNC, "max_staleness": 4},
        groups={"sync": ["2.*"], "round_buffers": 2},
    )
    try:
        kh = cluster.keyholder
        sync = group_mask(create_model("mlp", num_features=64, num_classes=10), ["2.*"])
        rng = np.random.default_rng(3)
        start = rng.normal(0, 0.1, sync.size)
        kh.initialize(start)
        first = {c: rng.uniform(-0.5, 0.5, sync.size) for c in ("a", "b", "c")}
        second = {c: rng.uniform(-0.5, 0.5, sync.size) for c in ("d", "e", "f")}
        fn = create_staleness("polynomial", a=0.5)
        # Execute: flush 1 (all trained on version 0)
        one = _flush(cluster, 1, 0, first, {c: 0 for c in first})
        after_one = kh.params
        assert after_one is not None
        # Assert: async values moved by the flush's average; sync values did not move at all
        assert not one.sync_groups_applied
        mean_one = sum(first.values()) / 3
        assert np.array_equal(after_one[sync], start[sync])
        assert _close(after_one[~sync], (start + mean_one)[~sync])
        # Execute: flush 2 closes the round (trained on versions 1, 1 and 0)
        trained_on = {"d": 1, "e": 1, "f": 0}
        two = _flush(cluster, 2, 1, second, trained_on)
        after_two = kh.params
        assert after_two is not None
        # Assert: async values moved by flush 2's staleness-weighted average; sync values by
        # the weighted average of all six updates of the round
        assert two.sync_groups_applied
        m = {c: multiplier(fn, 1 - v) for c, v in trained_on.items()}
        mean_two = sum(m[c] * second[c] for c in second) / sum(m.values())
        assert _close(after_two[~sync], (after_one + mean_two)[~sync])
        weight_one = 3 * multiplier(fn, 0)
        round_mean = (weight_one * mean_one + sum(m[c] * second[c] for c in second)) / (
            weight_one + sum(m.values())
        )
        assert _close(after_two[sync], (start + round_mean)[sync])
    finally:
        cluster.stop()
