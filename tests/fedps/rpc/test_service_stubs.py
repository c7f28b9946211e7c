"""Tests for the typed service clients and their records: every record survives its protobuf
conversion unchanged, the clients talk to real servers on loopback, and no role handler
touches protobuf."""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from crypto.enrolment import read_token
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, context_digest, verify_block
from fedps.errors import FedPSError, RoundClosedError, UnauthenticatedError
from fedps.proto import common_pb2, shard_pb2
from fedps.rpc import coordinator_messages as co
from fedps.rpc import keyholder_messages as kh
from fedps.rpc import shard_messages as sh
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.messages import (
    Aggregate,
    Contribution,
    MalformedReplyError,
    ParameterBlock,
    signed_update_from_proto,
    signed_update_to_proto,
)
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import bind, create_server
from server.keyholder.keyholder import RoundResult
from tests.conftest import Cluster
from tests.waiting import HANG_S, wait_for

ROOT = Path(__file__).resolve().parents[3]
KEY = BlockSigner().public_key
UPDATE = SignedUpdate("client-0", 0.5, b"n" * 16, b"s" * 64, (b"r" * 32, b"t" * 32), 3)
BLOCK = ParameterBlock(2, 7, b"\0" * 16, b"g" * 64)
AGGREGATE = Aggregate(1, b"c" * 8, {"client-0": Contribution(0.5, b"r" * 32, 3, 2)})

RECORDS = [
    BLOCK,
    AGGREGATE,
    sh.RoundOpening(4, 3, {"client-0": KEY}, "ctx", "run", {"client-0": UPDATE}),
    sh.PushBatch("client-0", 4, 3, 0.5, "ctx", [(0, b"a"), (1, b"b")], b"n", b"s", (b"r" * 32,)),
    sh.PushReceipt(2, 1),
    sh.ClosedRound(("client-0", "client-1"), 5),
    sh.AggregatePart((AGGREGATE,), (UPDATE,)),
    sh.Publication(7, 10, 4, (BLOCK,)),
    sh.ShardStatus("shard-0", 7, 5, 4, True, 10, 1, 4096),
    kh.CommitOpening(4, 3, "run", "ctx", {"client-0": KEY}),
    kh.UpdateCommitment(4, UPDATE, b"\1" * 16),
    kh.CommitClosing(4, True),
    kh.CommitSet(("client-0",), True, (UPDATE,)),
    kh.PublicContextInfo(b"context", "ctx", KEY, b"g" * 64),
    kh.ModelUpload(40, (BLOCK,), True, 7),
    kh.ModelState(7, 40, True, 6, {"shard-1": 2}, ("shard-1",)),
    kh.ModelState(7, 40, True, 6, shard_misses={"shard-0": 1, "shard-1": 3}, stalled=("shard-1",)),
    kh.RoundApplication(4, 3, "run", {"client-0": KEY}),
    kh.AppliedRound(4, 3, 2.0, 0.25, 1.1, 0.01),
    kh.AppliedRound(4, 3, 2.0, 0.25, phase_seconds={"fetch": 0.25, "verify": 0.125}),
    kh.AppliedRound(4, 3, 2.0, 0.25, contributors=("client-0", "client-1")),
    co.ClientRegistration("edge-0", 60, 40, KEY, "client-0.ab", 1.5, 1e-5),
    co.ClientRegistration("edge-0", 60, 40, KEY, "", 1.5, 1e-5, "ab" * 32, 1.1, 0.05, 20),
    co.RegistrationReply("client-0", "run", "kh:1", {"shard-1": "s:2", "shard-0": "s:1"}, 8, 40, 5),
    co.AssignmentQuery("client-0", 1.5, 1e-5),
    *(
        co.Assignment(kind, 4, 3, 1e9, 0.5, 60.0, "ctx")
        for kind in ("wait", "train", "push", "done")
    ),
    co.Assignment("train", 4, 3, math.inf),
    co.UpdateReport("client-0", 4, 0.5, 1.5, 1e-5, 4096, True, 1.1),
    co.UpdateReport("client-0", 4, phase_seconds={"train": 0.5, "noise": 0.25, "push": 0.0}),
    co.RoundSummary(
        3,
        3,
        2,
        0.9,
        0.5,
        1.5,
        4096,
        2.5,
        False,
        0.75,
        phases={"open": 0.01, "train": 1.5, "other": 0.25},
        server_phases={"open": 0.01, "commit_wait": 1.75},
        client_phases={"client-1": {"train": 1.5}, "client-0": {"train": 1.25, "push": 0.5}},
    ),
    co.ClusterStatus(
        "run",
        4,
        3,
        2,
        False,
        (co.RoundSummary(3, 3, 2, -1.0, 0.5, 1.5, 4096, 2.5, False, 0.75),),
        1.5,
        1e-5,
        8192,
        1e9,
        {"client-0": 1.5},
        "secure",
        {"client-0": 1.1},
        {"client-0": 3},
        {"shard-1": 2},
        ("shard-1",),
    ),
    co.ClusterStatus(
        "run",
        4,
        3,
        1,
        False,
        (),
        2.5,
        1e-5,
        0,
        0.0,
        {"client-0": 2.5},
        client_reported_epsilons={"client-0": 0.5},
        privacy_warnings=("client-0 registered with a new signing key",),
        spent_clients=("client-0",),
        flagged_clients=("client-0",),
    ),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_survives_its_protobuf_round_trip(record: object) -> None:
    # Prepare
    wire = record.to_proto()  # type: ignore[attr-defined]
    # Execute
    back = type(record).from_proto(type(wire).FromString(wire.SerializeToString()))  # type: ignore[attr-defined]
    # Assert
    assert back == record


def test_signed_update_round_trip_and_push_bytes() -> None:
    # Execute
    back = signed_update_from_proto(
        common_pb2.SignedUpdate.FromString(signed_update_to_proto(UPDATE).SerializeToString())
    )
    batch = RECORDS[3]
    assert isinstance(batch, sh.PushBatch)
    # Assert
    assert back == UPDATE
    assert sh.PushBatch.from_bytes(batch.serialize()) == batch


@pytest.mark.parametrize(
    "blocks",
    [[], [(0, b"")], [(0, b"\1" * 300), (127, b"\2" * 19_996), (128, b"")], [(5, b"\3" * 70_000)]],
)
def test_a_push_framed_around_its_ciphertexts_is_protobuf_s_message(
    blocks: list[tuple[int, bytes]],
) -> None:
    # Prepare
    batch = sh.PushBatch("client-0", 4, 3, 0.5, "ctx", blocks, b"n" * 16, b"s" * 64, (b"r" * 32,))
    # Execute
    wire = batch.serialize()
    # Assert: the same message, as many bytes as protobuf's own encoding
    message = batch.to_proto()
    assert shard_pb2.PushRequest.FromString(wire) == message
    assert len(wire) == message.ByteSize()


def test_a_push_carries_the_update_it_was_built_from() -> None:
    # Execute
    batch = sh.PushBatch.carrying(UPDATE, round_=4, context_id="ctx", blocks=[(0, b"a")])
    # Assert
    assert batch.update == UPDATE
    assert (batch.client_id, batch.round, batch.context_id) == ("client-0", 4, "ctx")


def test_a_later_message_takes_its_streams_commitment_only_from_the_same_update() -> None:
    # Prepare: a stream's first message, and later ones without the commitment
    first = sh.PushBatch.carrying(UPDATE, round_=4, context_id="ctx", blocks=[(0, b"a")])
    later = sh.PushBatch.carrying(
        UPDATE, round_=4, context_id="ctx", blocks=[(1, b"b")], signed=False
    )
    other_weight = dataclasses.replace(later, weight=2.0)
    other_round = dataclasses.replace(later, round=5)

    # Execute / Assert: the same update's message carries the commitment again
    assert not later.signature and not later.roots
    assert later.inheriting(first).update == UPDATE
    assert later.inheriting(None) == later
    # another weight or round keeps none: the shard then refuses it as unsigned
    assert other_weight.inheriting(first) == other_weight
    assert other_round.inheriting(first) == other_round
    # a message that carries its own is never changed
    assert first.inheriting(dataclasses.replace(first, nonce=b"x" * 16)) == first


def test_a_wire_record_takes_its_fields_from_a_richer_record() -> None:
    # Prepare: the key holder's result of a round has more than its reply carries, and less:
    # the call's phases are given apart, and its contributors by id only
    result = RoundResult(5, 8, 3, 3.0, 0.25, contributors={"client-0": 1.0}, top_up_std=0.5)
    # Execute
    applied = kh.AppliedRound.taken_from(
        result, phase_seconds={"fetch": 0.5}, contributors=("client-0",)
    )
    # Assert
    assert applied == kh.AppliedRound(8, 3, 3.0, 0.25, 0.0, 0.5, {"fetch": 0.5}, ("client-0",))


def test_a_manifest_that_lists_a_client_twice_is_malformed() -> None:
    # Prepare
    wire = AGGREGATE.to_proto()
    wire.contributions.append(wire.contributions[0])
    # Execute / Assert
    with pytest.raises(MalformedReplyError):
        Aggregate.from_proto(wire)


def test_only_servicers_logs_and_service_clients_touch_protobuf() -> None:
    # Prepare
    modules = [
        *sorted(ROOT.glob("server/*/*.py")),
        *sorted(ROOT.glob("clients/*.py")),
        ROOT / "clients/flower/flower_client.py",
    ]
    # Execute
    offenders = {
        str(path.relative_to(ROOT))
        for path in modules
        if not path.name.endswith(("_servicer.py", "_log.py"))
        and re.search(r"\b\w+_pb2(_grpc)?\b", path.read_text())
    }
    # Assert
    assert not offenders, sorted(offenders)


@pytest.mark.integration
def test_service_clients_against_a_running_cluster(cluster: Cluster) -> None:
    # Prepare: wait for the coordinator to publish version 0 (on every shard)
    wait_for(lambda: all(s.owned_blocks for s in cluster.shards), "the first published model")
    config = cluster.config.cluster
    keyholder = KeyHolderStub(config.keyholder)
    shards = [ShardStub(s, a) for s, a in zip(config.shard_ids, config.shards, strict=True)]
    try:
        # Execute: the key holder's read calls
        info = keyholder.get_public_context()
        state = keyholder.get_model_state()
        # Assert
        assert info.context_id == cluster.keyholder.context_id
        assert verify_block(
            info.signing_key, context_digest(info.context, info.context_id), info.signature
        )
        assert cluster.keyholder.params is not None
        assert state.initialized and state.num_params == cluster.keyholder.params.size
        with pytest.raises(RoundClosedError):
            keyholder.get_challenge(99, "client-9")
        # Execute: every shard serves its blocks and its status; a closed round is unknown
        for client, shard in zip(shards, cluster.shards, strict=True):
            blocks = client.pull_blocks()
            status = client.get_status()
            assert sorted(b.block for b in blocks) == shard.owned_blocks
            assert status.shard_id == shard.shard_id and status.blocks == len(shard.owned_blocks)
            with pytest.raises(RoundClosedError):
                list(client.fetch_aggregate(99, ["client-0"]))
        with pytest.raises(FedPSError):
            shards[0].open_round(sh.RoundOpening(99, 0, {}, info.context_id))
    finally:
        keyholder.close()
        for client in shards:
            client.close()


@pytest.mark.integration
def test_coordinator_client_against_a_running_cluster(cluster: Cluster) -> None:
    # Prepare
    config = cluster.config
    token = read_token(config.tls.directory, "client-0")
    assert token is not None
    num_params = cluster.coordinator.layout.num_params
    delta = config.privacy.delta
    coordinator = CoordinatorStub(config.cluster.coordinator)
    stranger = CoordinatorStub(config.cluster.coordinator)
    try:
        # Execute
        registered = coordinator.register(
            co.ClientRegistration("edge-0", 10, num_params, KEY, token, 0.5, delta)
        )
        task = coordinator.get_task(co.AssignmentQuery(registered.client_id, 0.75, delta))
        coordinator.report_update(
            co.UpdateReport(registered.client_id, task.round, 1.0, 0.75, delta)
        )
        status = coordinator.get_status()
        # Assert: the reply names the cluster, the credential rides on every later call ...
        cluster_config = config.cluster
        assert registered.client_id == "client-0" and registered.credential
        assert registered.run_id == cluster.coordinator.run_id == status.run_id
        assert registered.keyholder == cluster_config.keyholder
        assert registered.shards == dict(
            zip(cluster_config.shard_ids, cluster_config.shards, strict=True)
        )
        assert registered.num_params == num_params
        assert task.kind in ("wait", "train")
        assert status.registered == 1
        assert status.client_epsilons == {"client-0": 0.75}
        # ... and a client without it is refused
        with pytest.raises(UnauthenticatedError):
            stranger.get_task(co.AssignmentQuery(registered.client_id))
    finally:
        coordinator.close()
        stranger.close()


def _fetch_seen(fetched: threading.Event) -> grpc.GenericRpcHandler[Any, Any]:
    """A shard's FetchAggregate that only notes that a fetch reached it, and answers nothing."""

    def fetch(
        request: shard_pb2.FetchAggregateRequest, context: grpc.ServicerContext
    ) -> Iterator[shard_pb2.FetchAggregateReply]:
        fetched.set()
        return iter(())

    handler = grpc.unary_stream_rpc_method_handler(
        fetch,
        request_deserializer=shard_pb2.FetchAggregateRequest.FromString,
        response_serializer=shard_pb2.FetchAggregateReply.SerializeToString,
    )
    return grpc.method_handlers_generic_handler("fedps.proto.Shard", {"FetchAggregate": handler})


def test_a_fetch_reaches_the_shard_before_its_reply_is_read() -> None:
    # Prepare
    fetched = threading.Event()
    server = create_server()
    server.add_generic_rpc_handlers((_fetch_seen(fetched),))
    port = bind(server, "127.0.0.1:0")
    server.start()
    stub = ShardStub("shard-0", f"127.0.0.1:{port}")
    try:
        # Execute: the reply is not read yet
        reply = stub.fetch_aggregate(3, ["client-0"])
        # Assert
        assert fetched.wait(HANG_S)
        assert list(reply) == []
    finally:
        stub.close()
        server.stop(grace=None)
