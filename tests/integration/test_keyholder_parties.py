"""End to end with key-holder parties: 2 of 3 parties decrypt every round, none holds the key.

Real servers on loopback: two shards, a coordinator, a key holder that is the parties'
combiner (no secret key in its folder), and three party servers, each with its own share,
state folder and view of the round (the coordinator's closed set, the shards' sums). Clients
encrypt under the joint public context with the unchanged client code and train two rounds of
the digits task with real Opacus; party 1 stops answering after the first round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import pytest

from crypto import threshold as th
from crypto.files import private_directory, write_atomic
from crypto.signing import BlockSigner
from fedps.errors import PeerUnavailableError
from fedps.proto import keyholder_party_pb2_grpc
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_party_messages import DecryptionRequest, PartyCanaries
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import bind, create_server
from fedps.sharding.hash_ring import HashRing
from server.keyholder.cluster_round_source import ClusterRoundSource
from server.keyholder.joint_keys import JOINT_CONTEXT_FILE, JointKeys
from server.keyholder.keyholder_party import LEDGER_FILE, KeyHolderParty
from server.keyholder.keyholder_party_servicer import KeyHolderPartyServicer
from server.keyholder.party_key_generation import generate_in_one_process
from tests.conftest import Cluster, RecordingClient, run_clients, start_cluster, start_coordinator
from tests.crypto.threshold_keys import PARAMS

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PARTIES, THRESHOLD, LAMBDA = 3, 2, 16
CLIENTS, ROUNDS = 3, 2


class _DownFromRound:
    """Party 1 as a process that stops answering once a round's number reaches ``round_``."""

    def __init__(self, party: KeyHolderParty, round_: int) -> None:
        self._party, self._round = party, round_

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        self._answer(request)
        return self._party.canary_partial(request)

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        self._answer(request)
        return self._party.partial_decrypt(request)

    def prepare(self, request: DecryptionRequest) -> bool:
        self._answer(request)
        return self._party.prepare(request)

    def _answer(self, request: DecryptionRequest) -> None:
        if request.round >= self._round:
            raise PeerUnavailableError("party 1 is down")


def _generate_keys(root: Path) -> dict[int, tuple[th.KeyShare, Path]]:
    """The parties' collective key generation, each writing into its own folder."""
    seed = b"the parties' common seed, agreed"
    generations = generate_in_one_process(PARAMS, parties=PARTIES, threshold=THRESHOLD, seed=seed)
    return {
        j: (g.finish(root / f"party-{j}")[0], root / f"party-{j}") for j, g in generations.items()
    }


@pytest.fixture
def parties_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, list[grpc.Server]]]:
    # the parties' keys, and the joint public context in the combiner's keys folder
    keys = _generate_keys(tmp_path / "parties")
    joint = (keys[1][1] / "public.ctx").read_bytes()
    keys_dir = private_directory(tmp_path / "state" / "keyholder" / "keys")
    write_atomic(keys_dir / JOINT_CONTEXT_FILE, joint)
    servers = [create_server() for _ in range(PARTIES)]
    addresses = [f"127.0.0.1:{bind(server, '127.0.0.1:0')}" for server in servers]
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"rounds": ROUNDS, "clients": CLIENTS, "min_quorum": 2, "lr": 0.3},
        keyholder={"parties": PARTIES, "threshold": THRESHOLD, "lambda_bits": LAMBDA},
        cluster={"parties": addresses},
    )
    config = cluster.config
    public = cast(JointKeys, cluster.keyholder.keys).public
    combiner_key = bytes.fromhex((keys_dir / "signing.pub").read_text().strip())
    signers = {j: BlockSigner() for j in keys}
    ring = HashRing(config.cluster.shard_ids, virtual_nodes=config.cluster.virtual_nodes)
    for (j, (share, folder)), server in zip(keys.items(), servers, strict=True):
        source = ClusterRoundSource(
            CoordinatorStub(config.cluster.coordinator),
            {
                sid: ShardStub(sid, a)
                for sid, a in zip(config.cluster.shard_ids, config.cluster.shards, strict=True)
            },
            ring,
            public,
        )
        party = KeyHolderParty(
            share,
            public,
            combiner_key=combiner_key,
            signer=signers[j],
            party_keys={k: s.public_key for k, s in signers.items()},
            source=source,
            state_dir=folder,
            min_quorum=config.training.min_quorum,
            lambda_bits=LAMBDA,
        )
        served = cast(KeyHolderParty, _DownFromRound(party, 2)) if j == 1 else party
        keyholder_party_pb2_grpc.add_KeyHolderPartyServicer_to_server(
            KeyHolderPartyServicer(served), server
        )
        server.start()
    start_coordinator(cluster)
    yield cluster, servers
    for server in servers:
        server.stop(0)
    cluster.stop()


def test_two_of_three_parties_train_like_plaintext_fedavg_within_their_flooding(
    parties_cluster: tuple[Cluster, list[grpc.Server]], tmp_path: Path
) -> None:
    # Prepare
    cluster, _ = parties_cluster
    config = cluster.config
    clients = [RecordingClient.open(config, index=i) for i in range(CLIENTS)]
    initial = cluster.coordinator.evaluator.initial_vector()

    # Execute
    run_clients(clients)

    # Assert: the plaintext replay, within the parties' flooding of each round's sum
    expected = initial.copy()
    bound = 0.0
    keys = cast(JointKeys, cluster.keyholder.keys)
    for round_ in range(1, ROUNDS + 1):
        sent = [c.sent[round_] for c in clients]
        total = sum(w for w, _ in sent)
        expected = expected + sum(w * d for w, d in sent) / total
        decryption = th.joint_value_bound(PARAMS, len(sent), PARTIES) / PARAMS.scale
        bound += (keys.flooding_bound(len(sent)) + decryption) / total
    applied = cluster.keyholder.params
    assert applied is not None
    assert cluster.keyholder.version == ROUNDS
    assert np.abs(applied - expected).max() <= bound
    sigma = th.flooding_std(PARAMS, CLIENTS, parties=PARTIES, lambda_bits=LAMBDA) / PARAMS.scale
    noise = float(np.std(applied - expected))  # the flooding is there, and as large as said
    assert 0.5 < noise / (math.sqrt(THRESHOLD * ROUNDS) * sigma / CLIENTS) < 2
    # party 1 decrypted round 1 and was down for round 2, which parties 2 and 3 decrypted
    assert keys.decryptor.down == {1}
    ledger = (tmp_path / "parties" / "party-1" / LEDGER_FILE).read_bytes()
    assert b'"1"' in ledger and b'"2"' not in ledger
    assert not (tmp_path / "state" / "keyholder" / "keys" / "secret.key").exists()
