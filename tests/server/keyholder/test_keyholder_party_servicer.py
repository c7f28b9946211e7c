"""Tests for key-holder parties over gRPC: real servers on loopback, the combiner's stubs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from crypto import threshold as th
from crypto.signing import BlockSigner
from fedps.errors import PeerUnavailableError, PolicyError
from fedps.proto import keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import ROWS_PER_MESSAGE
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.rpc.transport import bind, create_server
from server.keyholder.joint_decryptor import JointDecryptor
from server.keyholder.keyholder_party_servicer import KeyHolderPartyServicer
from tests.crypto.threshold_keys import PARAMS, Joint, N, aggregate, generate
from tests.server.keyholder.party_cluster import LAMBDA, Rounds, start_parties

COHORT = ("a", "b", "c", "d")
BLOCKS = ROWS_PER_MESSAGE + 3  # more than one streamed message per partial


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(3)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    # one real block repeated: the stream's framing is what matters here, not the values
    one = aggregate(joint.public, len(COHORT), 1)[0]
    return np.repeat(one, BLOCKS, axis=0)


@pytest.fixture
def served(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> Iterator[tuple[JointDecryptor, dict[int, grpc.Server]]]:
    """Three 2-of-3 parties, each its own gRPC server on port 0, and the combiner's stubs."""
    rounds = Rounds()
    for round_ in (1, 2, 3):
        rounds.add(round_, COHORT, rows)
    signer = BlockSigner()
    servers: dict[int, grpc.Server] = {}
    stubs: dict[int, KeyHolderPartyStub] = {}
    for index, peer in start_parties(joint, 2, rounds, signer, tmp_path).items():
        server = create_server()
        keyholder_party_pb2_grpc.add_KeyHolderPartyServicer_to_server(
            KeyHolderPartyServicer(peer.party), server
        )
        port = bind(server, "127.0.0.1:0", role=f"party-{index}")
        server.start()
        servers[index] = server
        stubs[index] = KeyHolderPartyStub(f"127.0.0.1:{port}", n=N, timeout_s=60)
    yield JointDecryptor(stubs, threshold=2, modulus=joint.modulus, signer=signer), servers
    for server in servers.values():
        server.stop(0)
    for stub in stubs.values():
        stub.close()


def test_parties_over_grpc_decrypt_and_carry_on_without_one(
    joint: Joint,
    rows: np.ndarray,
    served: tuple[JointDecryptor, dict[int, grpc.Server]],
) -> None:
    # Prepare
    combiner, servers = served
    blocks = list(range(BLOCKS))
    sigma = th.flooding_std(PARAMS, len(COHORT), parties=3, lambda_bits=LAMBDA)
    bound = 13 * math.sqrt(2) * sigma + 2
    exact = joint.exact(rows[:1])
    # Execute / Assert: every row streamed back, each within the flooding of the exact one
    plain = combiner.decrypt(1, COHORT, blocks, rows)
    assert plain.shape == (BLOCKS, N)
    assert np.abs(plain - exact).max() <= bound
    # a party stopped: the other two decrypt the next round
    servers[2].stop(0).wait()
    assert np.abs(combiner.decrypt(2, COHORT, blocks, rows) - exact).max() <= bound
    assert combiner.down == {2}
    # two stopped: a clear line, nothing decrypted
    servers[1].stop(0).wait()
    with pytest.raises(PeerUnavailableError, match=r"down: party 1, party 2"):
        combiner.decrypt(3, COHORT, blocks, rows)


def test_a_party_refusal_crosses_the_wire_as_itself(
    rows: np.ndarray, served: tuple[JointDecryptor, dict[int, grpc.Server]]
) -> None:
    # Prepare: a sub-cohort of the closed round
    combiner, _ = served
    # Execute / Assert
    with pytest.raises(PolicyError, match="coordinator closed"):
        combiner.decrypt(1, COHORT[:3], list(range(BLOCKS)), rows)
