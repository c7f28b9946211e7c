"""Bad input against a real shard over gRPC: a clear status each time, and it keeps serving."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from crypto import BlockEncryptor, bitpack
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner
from fedps.proto import common_pb2, shard_pb2, shard_pb2_grpc
from fedps.rpc.transport import MAX_MESSAGE_BYTES, create_channel
from fedps.runtime.deployment import free_port
from tests.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

COHORT = ["client-a", "client-b"]
SIGNERS = {client: BlockSigner() for client in [*COHORT, "mallory"]}
RUN = "hostile-run"


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Key holder and one shard, model published, round 1 open for COHORT."""
    tmp: Path = tmp_path_factory.mktemp("hostile")
    metrics = {"shards": [f"127.0.0.1:{free_port()}"]}
    cluster = start_cluster(tmp, num_shards=1, coordinator=False, metrics=metrics)
    kh = cluster.keyholder
    kh.initialize(np.zeros(3000))
    members = {c: SIGNERS[c].public_key for c in COHORT}
    cluster.shards[0].open_round(1, 0, members, kh.keys.public.context_id, RUN)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stub(open_cluster: Cluster) -> shard_pb2_grpc.ShardStub:
    return shard_pb2_grpc.ShardStub(create_channel(open_cluster.config.cluster.shards[0]))


def _push(
    cluster: Cluster,
    *,
    client: str = "client-a",
    round_: int = 1,
    version: int = 0,
    blocks: list[tuple[int, bytes]] | None = None,
    context_id: str | None = None,
    signed_round: int | None = None,
    signer: BlockSigner | None = None,
    unsigned: bool = False,
) -> shard_pb2.PushRequest:
    """A push of a real update, signed as a client would sign it unless told otherwise."""
    public = cluster.keyholder.keys.public
    packed, coefficients = BlockEncryptor(public).encrypt_with_coefficients(np.full(3000, 0.5))
    signed = SignedUpdate.sign(
        signer or SIGNERS[client],
        coefficients,
        run_id=RUN,
        round_=round_ if signed_round is None else signed_round,
        client_id=client,
        context_id=public.context_id,
        weight=1.0,
    )
    nonce, signature, roots = signed.nonce, signed.signature, signed.roots
    if blocks is None:
        blocks = sorted(packed.items())
    return shard_pb2.PushRequest(
        client_id=client,
        round=round_,
        version=version,
        weight=1.0,
        context_id=public.context_id if context_id is None else context_id,
        blocks=[shard_pb2.EncryptedBlock(block=b, ciphertext=c) for b, c in blocks],
        nonce=nonce,
        signature=b"" if unsigned else signature,
        roots=roots,
    )


def _expect(
    stub: shard_pb2_grpc.ShardStub, request: shard_pb2.PushRequest, code: grpc.StatusCode
) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.PushBlocks(iter([request]))
    assert info.value.code() == code, info.value.details()
    details: str = info.value.details() or ""
    assert details
    return details


def _still_serving(stub: shard_pb2_grpc.ShardStub) -> None:
    replies = list(stub.PullBlocks(shard_pb2.PullRequest()))
    assert sum(len(r.blocks) for r in replies) == 2


def test_malformed_ciphertext_length(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    # Prepare
    request = _push(open_cluster, blocks=[(0, b"\x00" * 100)])
    # Execute
    details = _expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT)
    # Assert
    assert "exactly" in details
    _still_serving(stub)


def test_coefficient_out_of_range(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    # Prepare: a ciphertext whose coefficients are all q (wrong parameters / forged)
    public = open_cluster.keyholder.keys.public
    coeffs = np.full(public.coeffs_per_block, public.modulus, dtype=np.uint64)
    request = _push(open_cluster, blocks=[(0, bitpack.pack(coeffs, public.coeff_bits))])
    # Execute
    details = _expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT)
    # Assert
    assert "below q" in details
    _still_serving(stub)


def test_foreign_key_generation(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    request = _push(open_cluster, context_id="f" * 64)
    details = _expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT)
    assert "key generation" in details
    _still_serving(stub)


def test_unknown_client(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    details = _expect(stub, _push(open_cluster, client="mallory"), grpc.StatusCode.NOT_FOUND)
    assert "mallory" in details
    _still_serving(stub)


def test_closed_or_unknown_round(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    # A round before the open one is closed; a later one is not open yet (the committed
    # clients of a round push as soon as the key holder froze it: they retry UNAVAILABLE).
    details = _expect(stub, _push(open_cluster, round_=0), grpc.StatusCode.FAILED_PRECONDITION)
    assert "round 0" in details
    details = _expect(stub, _push(open_cluster, round_=7), grpc.StatusCode.UNAVAILABLE)
    assert "round 7" in details and "yet" in details
    _still_serving(stub)


def test_wrong_version(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    details = _expect(stub, _push(open_cluster, version=5), grpc.StatusCode.INVALID_ARGUMENT)
    assert "version" in details


def test_oversized_message(open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub) -> None:
    # Prepare: one message larger than the negotiated maximum
    request = _push(open_cluster, blocks=[(0, b"\x01" * (MAX_MESSAGE_BYTES + 1024))])
    # Execute / Assert
    _expect(stub, request, grpc.StatusCode.RESOURCE_EXHAUSTED)
    _still_serving(stub)


def test_duplicate_push_is_acknowledged_not_added(
    open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub
) -> None:
    # Prepare
    request = _push(open_cluster, client="client-b")
    before = stub.GetStatus(common_pb2.Empty())
    # Execute
    first = stub.PushBlocks(iter([request]))
    second = stub.PushBlocks(iter([request]))
    # Assert: both acknowledged, the second as duplicates, nothing counted as refused
    assert (first.accepted, first.duplicates) == (2, 0)
    assert (second.accepted, second.duplicates) == (0, 2)
    after = stub.GetStatus(common_pb2.Empty())
    assert after.pushes_accepted == before.pushes_accepted + 2
    assert after.pushes_refused == before.pushes_refused


@pytest.mark.parametrize(
    "bad",
    [
        {"unsigned": True},
        {"signer": BlockSigner()},  # signed with a key the client did not register
        {"signed_round": 0},  # a signature replayed from another round
    ],
    ids=["unsigned", "mis-signed", "replayed"],
)
def test_signature_is_required(
    open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub, bad: dict[str, object]
) -> None:
    # Prepare
    request = _push(open_cluster, **bad)  # type: ignore[arg-type]
    # Execute
    details = _expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT)
    # Assert
    assert "signature" in details
    _still_serving(stub)


def test_block_swapped_after_signing_is_refused(
    open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub
) -> None:
    # Prepare: a valid signed push whose ciphertext is replaced by another valid ciphertext
    request = _push(open_cluster)
    other = BlockEncryptor(open_cluster.keyholder.keys.public).encrypt(np.full(3000, 9.0))
    request.blocks[0].ciphertext = other[request.blocks[0].block]
    # Execute
    details = _expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT)
    # Assert
    assert "signed commitment" in details
    _still_serving(stub)


def _refused(cluster: Cluster) -> dict[str, float]:
    """The shard's Prometheus counters of refused pushes, by reason."""
    url = f"http://{cluster.config.metrics.shards[0]}/metrics"
    with urllib.request.urlopen(url, timeout=60) as reply:
        text = reply.read().decode()
    pattern = r'fedps_pushes_total\{outcome="refused",reason="(\w+)"\} ([0-9.e+]+)'
    return {reason: float(n) for reason, n in re.findall(pattern, text)}


def test_metrics_report_refused_pushes_by_reason(
    open_cluster: Cluster, stub: shard_pb2_grpc.ShardStub
) -> None:
    # Prepare
    before = _refused(open_cluster)
    # Execute: one push from outside the cohort, two for a round that is closed, one early
    bad = [
        _push(open_cluster, client="mallory"),
        _push(open_cluster, round_=0),
        _push(open_cluster, round_=0),
        _push(open_cluster, round_=8),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError):
            stub.PushBlocks(iter([request]))
    # Assert
    after = _refused(open_cluster)
    assert after["unknown_client"] - before.get("unknown_client", 0) == 1
    assert after["round_closed"] - before.get("round_closed", 0) == 2
    # (the channel's retry policy resends an UNAVAILABLE push a few times)
    assert after["not_ready"] - before.get("not_ready", 0) >= 1
