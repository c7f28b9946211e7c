"""The cluster the RPC fuzz drives, and the genuine material every service's oracles share.

:class:`FuzzCluster` starts a real cluster on loopback (key holder, one shard, coordinator),
registers three clients (``a`` and ``b`` are round 1's cohort, ``c`` registers afterwards),
commits ``a``'s and ``b``'s genuine signed updates and sketches as
:class:`clients.edge_client.EdgeClient` does, pushes one genuine block as the baseline and opens
round 2's commit phase with ``a`` committed and ``b`` not. It keeps the genuine requests, pools
of meaningful alternative values for the mutator, a snapshot of every server's state to
compare with after the fuzz, and one ordinary call per server to check that each still answers.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from crypto import BlockEncryptor, bitpack
from crypto.enrolment import issue_tokens, read_token
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, update_digest
from crypto.sketch import Challenge
from fedps.config import FedPSConfig
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
from fedps.rpc.transport import MAX_MESSAGE_BYTES, create_channel
from server.coordinator.coordinator_servicer import CREDENTIAL_HEADER
from tests.in_process_cluster import start_cluster
from tests.security.fuzz.values import U64, rand_bytes
from tests.waiting import wait_for

#: Deadline of the liveness checks' calls: a hang guard, far above their milliseconds.
_HANG_S = 60.0


@dataclass(frozen=True)
class CommitPhaseView:
    """What the key holder's commit board holds for one round (the oracles' view of it)."""

    members: dict[str, bytes]  # client id -> signing key
    committed: frozenset[str]
    frozen: bool


@dataclass
class GenuineUpdate:
    """One cohort client's genuine update: its packed blocks, their coefficients and (once
    committed) the signed header every push of it carries."""

    blocks: dict[int, bytes]
    coeffs: np.ndarray
    #: (round, version, context id, weight, nonce, signature, roots)
    header: tuple[object, ...] = field(default=())


class FuzzCluster:
    """A running cluster in round 1 and the genuine material to mutate."""

    def __init__(self, tmp: Path) -> None:
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.cluster = start_cluster(
            tmp,
            num_shards=1,
            coordinator=True,
            training={"clients": 2, "min_quorum": 2, "rounds": 1000, "deadline_s": 3600.0},
            security={"max_pushes_per_round": 1_000_000_000},
        )
        c = self.cluster
        self.shard, self.kh, self.coord = c.shards[0], c.keyholder, c.coordinator
        self.addresses = {
            "Shard": c.config.cluster.shards[0],
            "KeyHolder": c.config.cluster.keyholder,
            "Coordinator": c.config.cluster.coordinator,
        }
        wait_for(lambda: self.kh.params is not None and self.shard.model.published, "the model")
        public = self.kh.keys.public
        self.public = public
        self.n = public.params.values_per_block
        self.num_params = self.coord.layout.num_params
        self.num_blocks = self.coord.layout.num_blocks
        coord_stub = coordinator_pb2_grpc.CoordinatorStub(
            create_channel(self.addresses["Coordinator"])
        )
        self.signers: dict[str, BlockSigner] = {}
        self.ids: dict[str, str] = {}
        self.credentials: dict[str, bytes] = {}  # client id -> credential (if issued)
        self.credential_header = CREDENTIAL_HEADER
        # One provisioned identity each (the cluster runs without TLS: enrolment tokens).
        self.tokens = _enrolment_tokens(c.config, {"a": 0, "b": 1, "c": 2})
        for name in ("a", "b", "c"):
            signer = BlockSigner()
            reply = coord_stub.Register(
                coordinator_pb2.RegisterRequest(
                    name=f"fuzz-{name}",
                    num_examples=100,
                    num_params=self.num_params,
                    signing_key=signer.public_key,
                    enrolment_token=self.tokens.get(name, ""),
                )
            )
            self.signers[name], self.ids[name] = signer, reply.client_id
            credential = bytes(reply.credential)
            if credential:
                self.credentials[reply.client_id] = credential
            if name == "b":  # a and b are the cohort of round 1; c registers afterwards
                wait_for(lambda: bool(self.kh.commits._phases), "round 1's commit phase")
        a, b = self.ids["a"], self.ids["b"]
        self.cohort = {a, b}
        self.round = max(self.kh.commits._phases)
        phase = self.kh.commits._phases[self.round]
        assert set(phase.members) == self.cohort, phase.members
        self.version = phase.version
        self.run_id = self.coord.run_id
        self.context_id = self.kh.context_id
        self.cohort_keys = {
            cid: self.signers[n].public_key for n, cid in self.ids.items() if cid in self.cohort
        }
        self.cohort_members = [
            common_pb2.CohortMember(client_id=cid, signing_key=key)
            for cid, key in sorted(self.cohort_keys.items())
        ]

        # Genuine updates of both cohort clients (all blocks each), committed as a client
        # commits: the coordinator then freezes round 1's commitments and opens it on the shard.
        keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(self.addresses["KeyHolder"]))
        encryptor = BlockEncryptor(public)
        self.genuine: dict[str, GenuineUpdate] = {}
        for name in ("a", "b"):
            packed, coeffs = encryptor.encrypt_with_coefficients(
                np.full(self.num_params, 0.01 if name == "a" else -0.02)
            )
            self.genuine[self.ids[name]] = GenuineUpdate(dict(packed), coeffs)
        # (round, client) -> the genuine commitment
        self.commit_requests: dict[tuple[int, str], keyholder_pb2.CommitRequest] = {}
        self.seeds: dict[int, bytes] = {}
        for name in ("a", "b"):
            self._commit(keyholder, self.round, name, send=True)
        wait_for(
            lambda: self.shard.round_is_open and self.shard.open_round_number == self.round,
            "round 1 opening on the shard",
        )
        state = self.shard._rounds[self.round]
        assert set(state.members) == set(state.commitments) == self.cohort, state.commitments
        self.pushes: dict[str, shard_pb2.PushRequest] = {}
        for cid in sorted(self.cohort):
            update = self.commit_requests[(self.round, cid)].update
            self.genuine[cid].header = (
                self.round,
                self.version,
                self.context_id,
                update.weight,
                update.nonce,
                update.signature,
                tuple(update.roots),
            )
            self.pushes[cid] = shard_pb2.PushRequest(
                client_id=cid,
                round=self.round,
                version=update.version,
                weight=update.weight,
                context_id=self.context_id,
                blocks=[
                    shard_pb2.EncryptedBlock(block=b, ciphertext=x)
                    for b, x in self.genuine[cid].blocks.items()
                ],
                nonce=update.nonce,
                signature=update.signature,
                roots=update.roots,
            )
        # Baseline: client a's block 0, accepted for real; nothing else may ever be added.
        baseline = copy.deepcopy(self.pushes[a])
        del baseline.blocks[1:]
        shard_stub = shard_pb2_grpc.ShardStub(create_channel(self.addresses["Shard"]))
        pushed = shard_stub.PushBlocks(iter([baseline]))
        assert pushed.accepted == 1, pushed

        # Round 2's commit phase stays open with a committed and b not: b's commitments
        # reach every check of the key holder (a's, and round 1's, are settled already).
        self.open_round = self.round + 1
        self.open_requests = {
            r: keyholder_pb2.OpenCommitsRequest(
                round=r,
                version=self.version,
                run_id=self.run_id,
                members=self.cohort_members,
                context_id=self.context_id,
            )
            for r in (self.round, self.open_round)
        }
        keyholder.OpenCommits(self.open_requests[self.open_round])
        self._commit(keyholder, self.open_round, "a", send=True)
        self._commit(keyholder, self.open_round, "b", send=False)
        # What the key holder's commit board holds: the oracles' view of it.
        self.commit_phases = {
            self.round: CommitPhaseView(self.cohort_keys, frozenset({a, b}), frozen=True),
            self.open_round: CommitPhaseView(self.cohort_keys, frozenset({a}), frozen=False),
        }
        self.snapshot = self.take_snapshot()

        # Pools of meaningful alternative values for the mutator.
        q, bits = public.modulus, public.coeff_bits
        over_q = []
        for value, pos in [(q, 0), (q, -1), ((1 << bits) - 1, 7), (q + 12345, 1000)]:
            coeffs = self.genuine[a].coeffs[1].copy()
            coeffs[pos] = value
            over_q.append(bitpack.pack(coeffs, bits))
        zero_block = bitpack.pack(np.zeros(public.coeffs_per_block, dtype=np.uint64), bits)
        genuine_blocks = [x for g in self.genuine.values() for x in g.blocks.values()]
        ciphertexts = [
            *genuine_blocks,
            *over_q,
            zero_block,
            b"\xff" * public.block_bytes,
            genuine_blocks[0][:-1],
            genuine_blocks[0] + b"\x00",
            genuine_blocks[0][:-8],
            genuine_blocks[0] + b"\x00" * 8,
            b"",
        ]
        other_keys = [rand_bytes(random.Random(i), 32) for i in range(2)]
        keys = [
            self.signers["a"].public_key,
            self.signers["b"].public_key,
            *other_keys,
            b"\x00" * 32,
            b"\xff" * 32,
            b"\x01" * 31,
            b"\x01" * 33,
            b"",
        ]
        commits = list(self.commit_requests.values())
        all_roots = [r for cid in self.genuine for r in self.pushes[cid].roots]
        common_ids = [self.ids["c"], "", "mallory", "client-0", "x" * 1000, "\x00"]
        self.cohort_pools: dict[str, list[Any]] = {
            "client_id": [a, b, a + "x", a.upper(), *common_ids],
            "context_id": [
                self.context_id,
                "plaintext-insecure",
                self.context_id[:-1],
                self.context_id + "0",
                self.context_id.upper(),
                "0" * 64,
                "",
            ],
            "run_id": [self.run_id, "", self.run_id + "x", self.run_id.upper()],
            "ciphertext": ciphertexts,
            "signature": [
                *(m.update.signature for m in commits),
                rand_bytes(random.Random(7), 64),
                b"\x00" * 64,
                commits[0].update.signature[:63],
                commits[0].update.signature + b"\x00",
                b"",
            ],
            "nonce": [*(m.update.nonce for m in commits), b"", b"\x00" * 16],
            "roots": [*all_roots, b"\x00" * 32, all_roots[0][:31], all_roots[0] + b"\x00", b""],
            "signing_key": keys,
            "round": [0, self.round, self.open_round, self.round + 2, self.round - 1, U64],
            "version": [0, self.version, self.version + 1, U64],
            "block": [0, 1, 2, self.num_blocks - 1, self.num_blocks, 2**32 - 1],
            "weight": [1.0, 0.999999, 1e6, 1e6 + 1, 0.0, -1.0],
            "num_params": [self.num_params, self.num_params - 1, self.num_params + 1, 1, 0],
            "num_blocks": [self.num_blocks, self.num_blocks + 1, self.num_blocks - 1, 0, 1],
            "values_per_block": [self.n, self.n - 1, self.n + 1, 0, 1, 2 * self.n],
        }
        values = [
            self.shard.model._values[b].astype("<f4").tobytes()
            for b in sorted(self.shard.model._values)
        ]
        nan_block = np.full(self.n, np.nan, dtype="<f4").tobytes()
        inf_block = np.full(self.n, np.inf, dtype="<f4").tobytes()
        self.values_pool = [
            *values,
            nan_block,
            inf_block,
            values[0][:-4],
            values[0] + b"\x00" * 4,
            values[0] + b"\x00",
            values[0][:-1],
            b"",
        ]
        # Commitment material: sketches of every genuine commitment and near-valid
        # corruptions, and b's round-2 update signed (by b, unless said) over other fields.
        sketches = commits[0].sketches
        self.sketches_pool = [
            *(m.sketches for m in commits),
            sketches[:-8],
            sketches + b"\x00" * 8,
            sketches[:-1],
            sketches + sketches,
            np.full(len(sketches) // 8, q, dtype="<u8").tobytes(),
            np.full(len(sketches) // 8, U64, dtype="<u8").tobytes(),
            b"",
        ]
        update = self.commit_requests[(self.open_round, b)].update
        signed = dict(
            run_id=self.run_id,
            round_=self.open_round,
            client_id=b,
            context_id=self.context_id,
            weight=update.weight,
            nonce=bytes(update.nonce),
            roots=list(update.roots),
            version=update.version,
        )

        def forged(signer: str = "b", **change: Any) -> common_pb2.SignedUpdate:
            fields = {**signed, **change}
            return common_pb2.SignedUpdate(
                client_id=b,
                weight=fields["weight"],
                nonce=fields["nonce"],
                signature=self.signers[signer].sign(update_digest(**fields)),
                roots=fields["roots"],
                version=fields["version"],
            )

        roots = list(update.roots)
        self.forged_updates = [
            forged(weight=2.0),
            forged(weight=0.5),
            forged(weight=0.0),
            forged(weight=-1.0),
            forged(weight=math.nan),
            forged(weight=math.inf),
            forged(version=self.version + 1),
            forged(version=(self.version - 1) & U64),
            forged(roots=roots[:-1]),
            forged(roots=[*roots, roots[0]]),
            forged(roots=[]),
            forged(run_id=self.run_id + "x"),
            forged(context_id="plaintext-insecure"),
            forged(round_=self.round),
            forged(client_id=a),
            forged("a"),
            forged("c"),
        ]
        self.outsider_update = copy.deepcopy(self.commit_requests[(self.round, a)].update)
        self.outsider_update.client_id = self.ids["c"]
        self.commit_pools = {**self.cohort_pools, "sketches": self.sketches_pool}
        self.layout_blocks = [
            common_pb2.ParameterBlock(
                block=b,
                version=self.kh.version,
                values=v,
                signature=self.shard.model.signature_of(b),
            )
            for b, v in enumerate(self.values_pool[: self.num_blocks])
        ]
        self.value_pools = {**self.cohort_pools, "values": self.values_pool}
        self._live_stubs = (
            shard_pb2_grpc.ShardStub(create_channel(self.addresses["Shard"])),
            keyholder_pb2_grpc.KeyHolderStub(create_channel(self.addresses["KeyHolder"])),
            coordinator_pb2_grpc.CoordinatorStub(create_channel(self.addresses["Coordinator"])),
        )

    def _commit(
        self, keyholder: keyholder_pb2_grpc.KeyHolderStub, round_: int, name: str, *, send: bool
    ) -> None:
        """Client ``name``'s genuine commitment to ``round_``, as a client makes it: its
        update signed for the round, and its blocks' sketches under the round's challenge;
        ``send``: commit it at the key holder."""
        cid = self.ids[name]
        coeffs = self.genuine[cid].coeffs
        update = SignedUpdate.sign(
            self.signers[name],
            coeffs,
            run_id=self.run_id,
            round_=round_,
            client_id=cid,
            context_id=self.context_id,
            weight=1.0,
            version=self.version,
        )
        reply = keyholder.GetChallenge(keyholder_pb2.ChallengeRequest(round=round_, client_id=cid))
        seed = self.seeds.setdefault(round_, reply.seed)
        assert reply.seed == seed and len(seed) == 32, "two cohort members got other challenges"
        challenge = Challenge(
            seed, modulus=self.public.modulus, coeffs_per_block=self.public.coeffs_per_block
        )
        request = keyholder_pb2.CommitRequest(
            round=round_,
            update=signed_update_to_proto(update),
            sketches=challenge.sketch(coeffs).astype("<u8").tobytes(),
        )
        self.commit_requests[(round_, cid)] = request
        if send:
            keyholder.Commit(request)

    # ------------------------------------------------------------------ state
    def take_snapshot(self) -> dict[str, Any]:
        shard, kh, coord = self.shard, self.kh, self.coord
        state = shard._rounds[self.round]
        return {
            "accepted": shard.stats["accepted"],
            "sums": {b: s.coefficients for b, s in state.sums.items()},
            "entries": copy.deepcopy(state.entries),
            "round_closed": state.closed,
            "commitments": dict(state.commitments),
            "shard_rounds": sorted(shard._rounds),
            "shard_version": shard.version,
            "shard_blocks": {b: v.copy() for b, v in shard.model._values.items()},
            "kh_params": None if kh.params is None else kh.params.copy(),
            "kh_version": kh.version,
            "kh_last_round": kh.last_round,
            "kh_commit_phases": {
                r: (
                    p.version,
                    p.run_id,
                    p.context_id,
                    dict(p.members),
                    p.frozen,
                    {
                        c: (
                            signed_update_to_proto(x.update).SerializeToString(deterministic=True),
                            x.sketches.tobytes(),
                        )
                        for c, x in p.commitments.items()
                    },
                )
                for r, p in sorted(kh.commits._phases.items())
            },
            "kh_refused_rounds": sorted(kh._refused),
            "kh_detections": copy.deepcopy(kh.detections),
            "coord_round": coord.round,
            "coord_version": coord.version,
        }

    def compare(self, before: dict[str, Any]) -> list[str]:
        """Differences from a snapshot: each is a malformed request that changed state."""
        now = self.take_snapshot()
        problems = []
        if now["accepted"] != before["accepted"]:
            problems.append(
                f"shard accepted {now['accepted'] - before['accepted']} malformed block(s)"
            )
        if set(now["sums"]) != set(before["sums"]) or any(
            not np.array_equal(now["sums"][b], before["sums"][b]) for b in before["sums"]
        ):
            problems.append("the shard's running sums changed")
        for key in ("entries", "round_closed", "commitments", "shard_rounds", "shard_version"):
            if now[key] != before[key]:
                problems.append(f"shard {key} changed: {before[key]!r:.200} -> {now[key]!r:.200}")
        if set(now["shard_blocks"]) != set(before["shard_blocks"]) or any(
            not np.array_equal(now["shard_blocks"][b], before["shard_blocks"][b])
            for b in before["shard_blocks"]
        ):
            problems.append("the shard's published blocks changed")
        if now["kh_params"] is None or not np.array_equal(now["kh_params"], before["kh_params"]):
            problems.append("the key holder's model changed")
        for key in (
            "kh_version",
            "kh_last_round",
            "kh_commit_phases",
            "kh_refused_rounds",
            "kh_detections",
            "coord_round",
            "coord_version",
        ):
            if now[key] != before[key]:
                problems.append(f"{key} changed: {before[key]!r:.200} -> {now[key]!r:.200}")
        return problems

    def liveness(self) -> list[str]:
        """One ordinary call to every server; returns what failed."""
        shard, keyholder, coordinator = self._live_stubs
        empty = common_pb2.Empty()
        close_commits = keyholder_pb2.CloseCommitsRequest(round=self.round)  # takes its lock
        checks: dict[str, Callable[[], Any]] = {
            "Shard.GetStatus": lambda: shard.GetStatus(empty, timeout=_HANG_S),
            "KeyHolder.GetModelState": lambda: keyholder.GetModelState(empty, timeout=_HANG_S),
            "KeyHolder.CloseCommits": lambda: keyholder.CloseCommits(
                close_commits, timeout=_HANG_S
            ),
            "Coordinator.GetStatus": lambda: coordinator.GetStatus(empty, timeout=_HANG_S),
        }
        failed = []
        for name, check in checks.items():
            try:
                check()
            except grpc.RpcError as exc:
                code = exc.code().name if isinstance(exc, grpc.Call) else "?"
                failed.append(f"{name}: {code}")
        return failed


def _enrolment_tokens(config: FedPSConfig, names: dict[str, int]) -> dict[str, str]:
    """The enrolment token of each fuzz client (``client-N``), issued into the cluster's
    certificate directory; empty where registration takes no token."""
    directory = config.tls.directory
    issue_tokens(directory, [f"client-{i}" for i in names.values()])
    tokens = {name: read_token(directory, f"client-{i}") for name, i in names.items()}
    return {name: token for name, token in tokens.items() if token}
