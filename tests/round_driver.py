"""Drive rounds by hand through the real servers' gRPC faces, as coordinator and clients do.

Tests that play an attacker need to stop between the steps of a round: after the clients
committed, after they pushed, before the key holder fetches. :class:`RoundDriver` performs each
step with the same messages the coordinator and :class:`clients.edge_client.EdgeClient` send,
over real channels to the servers of a :class:`tests.conftest.Cluster`. :class:`TaskPoller`
is the other side: a registered client that only asks the real coordinator for tasks and
answers every ``TRAIN`` at once with an empty report, so rounds run without any training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crypto import BlockEncryptor, PublicContext, bitpack
from crypto.blinding import Blinding
from crypto.enrolment import read_token
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner
from crypto.sketch import Challenge
from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    keyholder_pb2,
    keyholder_pb2_grpc,
    shard_pb2,
    shard_pb2_grpc,
)
from fedps.rpc.messages import signed_update_to_proto
from fedps.rpc.transport import call, create_channel
from fedps.sharding.hash_ring import HashRing
from tests.conftest import Cluster, start_cluster

__all__ = ["HandClient", "RoundDriver", "TaskPoller", "driven_cluster"]


@dataclass
class HandClient:
    """One client's update for one round, encrypted and signed by hand."""

    client_id: str
    update: np.ndarray
    version: int = 0
    weight: float = 1.0
    signer: BlockSigner = field(default_factory=BlockSigner)
    packed: dict[int, bytes] = field(default_factory=dict)
    coefficients: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint64))
    signed: common_pb2.SignedUpdate = field(default_factory=common_pb2.SignedUpdate)
    signed_round: int = -1
    mask: bytes = b""  # the mask seed a sparsified update names (fedps.sharding.sparse_mask)
    #: what it commits to and pushes for ``signed_round``: ``coefficients`` plus the round's
    #: pads (crypto.blinding), in the full wire form
    sent: dict[int, bytes] = field(default_factory=dict)
    sent_coefficients: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint64))

    @property
    def member(self) -> common_pb2.CohortMember:
        return common_pb2.CohortMember(client_id=self.client_id, signing_key=self.signer.public_key)


class RoundDriver:
    """The coordinator's and the clients' calls of one round, one step at a time."""

    def __init__(self, config: FedPSConfig, public: PublicContext, *, run_id: str) -> None:
        self.run_id = run_id
        self.public = public
        self.keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(config.cluster.keyholder))
        cluster = config.cluster
        self.ring = HashRing(cluster.shard_ids, virtual_nodes=cluster.virtual_nodes)
        self.shards = {
            sid: shard_pb2_grpc.ShardStub(create_channel(address))
            for sid, address in zip(config.cluster.shard_ids, config.cluster.shards, strict=True)
        }

    # ------------------------------------------------------------------ coordinator
    def open_commits(self, round_: int, version: int, clients: list[HandClient]) -> None:
        request = keyholder_pb2.OpenCommitsRequest(
            round=round_,
            version=version,
            run_id=self.run_id,
            context_id=self.public.context_id,
            members=[c.member for c in clients],
        )
        call(lambda: self.keyholder.OpenCommits(request), "open commits")

    def freeze(self, round_: int) -> keyholder_pb2.CommitSet:
        request = keyholder_pb2.CloseCommitsRequest(round=round_, freeze=True)
        reply: keyholder_pb2.CommitSet = call(
            lambda: self.keyholder.CloseCommits(request), "freeze"
        )
        return reply

    def open_shards(
        self, round_: int, version: int, clients: list[HandClient], commits: keyholder_pb2.CommitSet
    ) -> None:
        request = shard_pb2.OpenRoundRequest(
            round=round_,
            version=version,
            members=[c.member for c in clients if c.client_id in commits.client_ids],
            context_id=self.public.context_id,
            run_id=self.run_id,
            commitments=list(commits.updates),
        )
        for stub in self.shards.values():
            call(lambda stub=stub: stub.OpenRound(request), "open round")  # type: ignore[misc]

    def close(self, round_: int) -> set[str]:
        """Close the round on every shard; the clients complete on all of them."""
        complete: set[str] | None = None
        for stub in self.shards.values():
            reply = call(
                lambda stub=stub: stub.CloseRound(  # type: ignore[misc]
                    shard_pb2.CloseRoundRequest(round=round_)
                ),
                "close",
            )
            if reply.blocks:
                done = set(reply.complete_clients)
                complete = done if complete is None else complete & done
        return complete or set()

    def apply(
        self, round_: int, version: int, clients: list[HandClient]
    ) -> keyholder_pb2.ApplyRoundReply:
        request = keyholder_pb2.ApplyRoundRequest(
            round=round_, version=version, run_id=self.run_id, members=[c.member for c in clients]
        )
        reply: keyholder_pb2.ApplyRoundReply = call(
            lambda: self.keyholder.ApplyRound(request), "apply"
        )
        return reply

    # ------------------------------------------------------------------ clients
    def encrypt(self, client: HandClient, round_: int) -> None:
        """Encrypt and sign the client's update for ``round_`` (once per round).

        ``client.packed`` and ``client.coefficients`` stay the unpadded ciphertexts (a test may
        change them); what it signs, commits to and pushes carries ``round_``'s pads when the
        key holder gives it the round's pad seed (:attr:`HandClient.sent`).
        """
        if client.signed_round == round_:
            return
        if not client.packed:
            encryptor = BlockEncryptor(self.public)
            client.packed, client.coefficients = encryptor.encrypt_with_coefficients(client.update)
        client.sent_coefficients = self.padded(round_, client, client.coefficients)
        if client.sent_coefficients is client.coefficients:
            client.sent = dict(client.packed)
        else:
            rows = bitpack.pack_rows(client.sent_coefficients, self.public.coeff_bits)
            client.sent = dict(enumerate(rows))
        signed = SignedUpdate.sign(
            client.signer,
            client.sent_coefficients,
            run_id=self.run_id,
            round_=round_,
            client_id=client.client_id,
            context_id=self.public.context_id,
            weight=client.weight,
            version=client.version,
            mask=client.mask,
        )
        client.signed = signed_update_to_proto(signed)
        client.signed_round = round_

    def padded(self, round_: int, client: HandClient, coefficients: np.ndarray) -> np.ndarray:
        """``coefficients`` (one row per block) with the client's pads of ``round_``.

        Unchanged (the same array) when the key holder gives no pad seed for the round (no
        commit phase, or not a member).
        """
        request = keyholder_pb2.ChallengeRequest(round=round_, client_id=client.client_id)
        try:
            seed = call(lambda: self.keyholder.GetChallenge(request), "challenge").pad_seed
        except FedPSError:
            return coefficients
        rows = coefficients.copy()
        blinding = Blinding(self.public.params, self.public.modulus)
        blinding.add(rows[:, : self.public.params.poly_modulus_degree], seed, range(len(rows)))
        return rows

    def challenge(self, round_: int, client: HandClient) -> Challenge:
        reply = call(
            lambda: self.keyholder.GetChallenge(
                keyholder_pb2.ChallengeRequest(round=round_, client_id=client.client_id)
            ),
            "challenge",
        )
        return Challenge(
            reply.seed,
            modulus=self.public.modulus,
            coeffs_per_block=self.public.coeffs_per_block,
        )

    def commit(
        self, round_: int, client: HandClient, *, sketch_of: np.ndarray | None = None
    ) -> None:
        """Commit the client's signed update and the sketches of its blocks (or of
        ``sketch_of``: what a lying client would send)."""
        self.encrypt(client, round_)
        coefficients = (
            client.sent_coefficients
            if sketch_of is None
            else self.padded(round_, client, sketch_of)
        )
        sketches = self.challenge(round_, client).sketch(coefficients)
        request = keyholder_pb2.CommitRequest(
            round=round_, update=client.signed, sketches=sketches.astype("<u8").tobytes()
        )
        call(lambda: self.keyholder.Commit(request), "commit")

    def push(self, round_: int, client: HandClient, blocks: dict[int, bytes] | None = None) -> None:
        """Push the client's blocks (or ``blocks``) to the shards that own them."""
        sent = client.sent if blocks is None else blocks
        by_shard: dict[str, list[shard_pb2.EncryptedBlock]] = {}
        for block, data in sorted(sent.items()):
            by_shard.setdefault(self.ring.owner(block), []).append(
                shard_pb2.EncryptedBlock(block=block, ciphertext=data)
            )
        for sid, encrypted in by_shard.items():
            message = shard_pb2.PushRequest(
                client_id=client.client_id,
                round=round_,
                version=client.version,
                weight=client.weight,
                context_id=self.public.context_id,
                blocks=encrypted,
                nonce=client.signed.nonce,
                signature=client.signed.signature,
                roots=client.signed.roots,
            )
            stub = self.shards[sid]
            call(lambda stub=stub, m=message: stub.PushBlocks(iter([m])), "push")  # type: ignore[misc]

    # ------------------------------------------------------------------ whole rounds
    def committed_round(self, round_: int, version: int, clients: list[HandClient]) -> None:
        """Every client commits and pushes; the round is closed on the shards."""
        self.open_commits(round_, version, clients)
        for client in clients:
            self.commit(round_, client)
        commits = self.freeze(round_)
        self.open_shards(round_, version, clients, commits)
        for client in clients:
            self.push(round_, client)
        self.close(round_)


class TaskPoller:
    """A registered client that takes part in rounds without training: it polls the
    coordinator for tasks and answers each ``TRAIN`` with a report of nothing pushed, which
    ends its part of the round. :attr:`asked` holds the rounds it was asked to train in."""

    def __init__(
        self, config: FedPSConfig, identity: str, *, num_params: int, poll_s: float = 0.02
    ) -> None:
        self.identity = identity
        self.asked: set[int] = set()
        self._poll_s = poll_s
        self._delta = config.privacy.delta
        self._stub = coordinator_pb2_grpc.CoordinatorStub(
            create_channel(config.cluster.coordinator)
        )
        token = read_token(config.tls.directory, identity)
        if token is None:
            raise RuntimeError(f"no enrolment token for {identity}")
        request = coordinator_pb2.RegisterRequest(
            name=identity,
            num_examples=1,
            num_params=num_params,
            signing_key=BlockSigner().public_key,
            enrolment_token=token,
        )
        reply = call(lambda: self._stub.Register(request), "register")
        self.client_id: str = reply.client_id
        self._metadata = (("x-fedps-credential", reply.credential.hex()),)

    def run(self, stop: threading.Event) -> None:
        """Poll until the coordinator says done or ``stop`` is set."""
        request = coordinator_pb2.TaskRequest(client_id=self.client_id)
        while not stop.is_set():
            task = call(lambda: self._stub.GetTask(request, metadata=self._metadata), "task")
            if task.kind == coordinator_pb2.Task.DONE:
                return
            if task.kind == coordinator_pb2.Task.TRAIN and task.round not in self.asked:
                self.asked.add(task.round)
                report = coordinator_pb2.UpdateReport(
                    client_id=self.client_id, round=task.round, delta=self._delta
                )
                call(lambda: self._stub.ReportUpdate(report, metadata=self._metadata), "report")  # noqa: B023
            time.sleep(self._poll_s)


@contextmanager
def driven_cluster(
    tmp_path: Path, *, num_shards: int, num_params: int, run_id: str
) -> Iterator[tuple[Cluster, RoundDriver]]:
    """A key holder and ``num_shards`` shards without a coordinator (3 clients, quorum 2),
    the key holder given a zero model of ``num_params``, and a driver for its rounds."""
    cluster = start_cluster(
        tmp_path, num_shards=num_shards, coordinator=False, training={"clients": 3, "min_quorum": 2}
    )
    try:
        cluster.keyholder.initialize(np.zeros(num_params))
        yield cluster, RoundDriver(cluster.config, cluster.keyholder.keys.public, run_id=run_id)
    finally:
        cluster.stop()
