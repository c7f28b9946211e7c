"""The ``KeyHolder`` service's RPCs: requests to start from, protocol-aware mutations and
oracles.

Commitments with corrupted sketches, forged or foreign signed updates and other rounds; commit
phases reopened with another cohort; challenges and commit sets checked against what the
cohort got. Nothing may be decrypted or applied: no round has valid aggregates.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np

from crypto.signing import is_weak_key
from fedps.proto import keyholder_pb2
from fedps.rpc.messages import signed_update_from_proto
from tests.security.fuzz.cluster import CommitPhaseView
from tests.security.fuzz.harness import GENUINE, LEGIT, SKIP, Metadata, RpcSpec, bad, empty
from tests.security.fuzz.mutator import Mutator, describe
from tests.security.fuzz.service_rpcs import ServiceRpcs
from tests.security.fuzz.values import U64, mutate_bytes


class KeyHolderRpcs(ServiceRpcs):
    """The ``KeyHolder`` service's RPCs."""

    service = keyholder_pb2.DESCRIPTOR.services_by_name["KeyHolder"]

    def mutate_commit(self, rng: random.Random) -> keyholder_pb2.CommitRequest:
        """A genuine commitment (mostly b's, still open in round 2) with its sketches, its
        signed update or its round replaced by a near-valid alternative."""
        keys = sorted(self.cluster.commit_requests)
        key = (
            (self.cluster.open_round, self.cluster.ids["b"])
            if rng.random() < 0.6
            else rng.choice(keys)
        )
        msg = copy.deepcopy(self.cluster.commit_requests[key])
        r = rng.random()
        if r < 0.4:
            msg.sketches = self.corrupt_sketches(rng, msg.sketches)
        elif r < 0.7:
            msg.update.CopyFrom(rng.choice(self.cluster.forged_updates))
        elif r < 0.8:
            msg.update.CopyFrom(self.cluster.commit_requests[rng.choice(keys)].update)
        elif r < 0.9:
            msg.round = rng.choice(self.cluster.cohort_pools["round"])
        else:
            Mutator(rng, self.cluster.commit_pools).mutate(msg, 1)
        if rng.random() < 0.1:
            Mutator(rng, self.cluster.commit_pools).mutate(msg, 1)
        return msg

    def corrupt_sketches(self, rng: random.Random, data: bytes) -> bytes:
        """Sketches with values >= q, the wrong length, or one value changed below q."""
        q = self.cluster.public.modulus
        values = np.frombuffer(data, dtype="<u8").copy()
        r = rng.random()
        if r < 0.35 and values.size:
            for _ in range(rng.choice([1, 1, 2, 5])):
                values[rng.randrange(values.size)] = rng.choice(
                    [q, q + 1, U64, 1 << 63, rng.randrange(q, 1 << 64)]
                )
            return values.tobytes()
        if r < 0.5 and values.size:  # well-formed, but not the client's sketch
            i = rng.randrange(values.size)
            values[i] = (int(values[i]) + rng.randrange(1, q)) % q
            return values.tobytes()
        if r < 0.7:
            return rng.choice(
                [data[:-8], data[:-1], data + b"\x00" * 8, data + data, data[8:], b""]
            )
        return mutate_bytes(rng, data, self.cluster.sketches_pool)

    def judge_initialize(
        self, msgs: list[keyholder_pb2.InitializeRequest], metadata: Metadata
    ) -> str:
        num_params = force = 0
        blocks: dict[int, bytes] = {}
        for m in msgs:
            num_params, force = m.num_params, m.force
            for item in m.blocks:
                if len(item.values) % 4:
                    return bad("values are not float32")
                blocks[item.block] = item.values
        if num_params == 0:
            return bad("no parameters")
        num_blocks = -(-num_params // self.cluster.n)
        if num_blocks > len(blocks):
            return bad(f"{num_params} parameters need {num_blocks} blocks, got {len(blocks)}")
        for b in range(num_blocks):
            if b not in blocks or len(blocks[b]) != 4 * self.cluster.n:
                return bad(f"block {b} is missing or has the wrong size")
        return SKIP if force else LEGIT  # force replaces the model; otherwise a no-op

    def judge_open_commits(
        self, msgs: list[keyholder_pb2.OpenCommitsRequest], metadata: Metadata
    ) -> str:
        m = msgs[0]
        members = {x.client_id: bytes(x.signing_key) for x in m.members}
        if m.context_id != self.cluster.context_id:
            return bad("the round names another key generation")
        if m.round <= self.cluster.kh.last_round:
            return bad("round already applied")
        if not members:
            return bad("empty cohort")
        if any(is_weak_key(k) for k in members.values()):
            return bad("a signing key is not a valid 32-byte Ed25519 key")
        phase = self.cluster.commit_phases.get(m.round)
        if phase is None:
            return SKIP  # a new commit phase (which may make the key holder forget round 1)
        if m.ring_version > 0:
            return SKIP  # a newer ring: followed (moving blocks), or refused if it is not one
        if (m.version, m.run_id, members) == (
            self.cluster.version,
            self.cluster.run_id,
            phase.members,
        ):
            return GENUINE  # the phase as it is open: a repeat changes nothing
        if phase.frozen:
            return bad("the round's commitments are frozen: no reopening with another cohort")
        return SKIP  # reopens round 2 afresh, dropping a's commitment

    def _cohort_phase(self, round_: int, client_id: str) -> CommitPhaseView | str:
        """The round's commit phase if ``client_id`` is in its cohort, else the verdict."""
        phase = self.cluster.commit_phases.get(round_)
        if phase is None:
            return bad("the round has no commit phase")
        if client_id not in phase.members:
            return bad("not a member of the round's cohort")
        return phase

    def judge_challenge(
        self, msgs: list[keyholder_pb2.ChallengeRequest], metadata: Metadata
    ) -> str:
        phase = self._cohort_phase(msgs[0].round, msgs[0].client_id)
        return phase if isinstance(phase, str) else GENUINE

    def judge_commit(self, msgs: list[keyholder_pb2.CommitRequest], metadata: Metadata) -> str:
        m = msgs[0]
        client = m.update.client_id
        phase = self._cohort_phase(m.round, client)
        if isinstance(phase, str):
            return phase
        genuine = self.cluster.commit_requests[(m.round, client)]
        same = signed_update_from_proto(m.update) == signed_update_from_proto(genuine.update)
        if client in phase.committed:
            if not same or m.sketches != genuine.sketches:
                return bad("a second, different commitment of a client that committed")
            serialized = m.update.SerializeToString(deterministic=True)
            if serialized == genuine.update.SerializeToString(deterministic=True):
                return GENUINE  # a retry after a lost acknowledgement
            return LEGIT  # the same commitment with unknown fields added
        if phase.frozen:
            return bad("the round's commitments are frozen")
        if not same:
            return bad("not the update the client signed for this round")
        values = np.frombuffer(m.sketches, dtype="<u8") if len(m.sketches) % 8 == 0 else None
        if (
            values is None
            or len(m.sketches) != len(genuine.sketches)
            or int(values.max()) >= self.cluster.public.modulus
        ):
            return bad("sketches are not one value below q per sketch and block")
        # b's own update with well-formed sketches: accepted (only the aggregate's check can
        # tell sketches that do not match the ciphertexts)
        return SKIP

    def judge_close_commits(
        self, msgs: list[keyholder_pb2.CloseCommitsRequest], metadata: Metadata
    ) -> str:
        m = msgs[0]
        phase = self.cluster.commit_phases.get(m.round)
        if phase is None:
            return bad("the round has no commit phase")
        if m.freeze and not phase.frozen:
            return SKIP  # would freeze round 2
        return GENUINE

    def check_challenge(self, reply: keyholder_pb2.Challenge) -> str | None:
        """A challenge must be the seed the cohort got for its round."""
        if self.cluster.seeds.get(reply.round) != reply.seed:
            return f"round {reply.round}: not the round's challenge seed"
        return None

    def check_commit_set(self, reply: keyholder_pb2.CommitSet) -> str | None:
        """A commit set must be one of the phases as the key holder holds them."""
        expected = set()
        for r, phase in self.cluster.commit_phases.items():
            committed = tuple(sorted(phase.committed))
            updates = tuple(
                self.cluster.commit_requests[(r, c)].update.SerializeToString(deterministic=True)
                for c in committed
            )
            expected.add((committed, phase.frozen, updates if phase.frozen else ()))
        got = (
            tuple(reply.client_ids),
            reply.frozen,
            tuple(u.SerializeToString(deterministic=True) for u in reply.updates),
        )
        return None if got in expected else f"a commit set of no phase: {describe(reply)}"

    def specs(self) -> list[RpcSpec[Any]]:
        c = self.cluster
        commit_keys = sorted(c.commit_requests)

        def initialize_base(rng: random.Random) -> keyholder_pb2.InitializeRequest:
            return keyholder_pb2.InitializeRequest(
                num_params=c.num_params,
                blocks=c.layout_blocks,
                force=rng.random() < 0.5,
                version=c.kh.version,
            )

        def apply_base(rng: random.Random) -> keyholder_pb2.ApplyRoundRequest:
            return keyholder_pb2.ApplyRoundRequest(
                round=c.round, version=c.version, run_id=c.run_id, members=c.cohort_members
            )

        def nothing_to_apply(msgs: list[keyholder_pb2.ApplyRoundRequest], _: Metadata) -> str:
            return bad("no round has valid aggregates")

        def challenge_base(rng: random.Random) -> keyholder_pb2.ChallengeRequest:
            return keyholder_pb2.ChallengeRequest(
                round=rng.choice(list(c.commit_phases)), client_id=rng.choice(sorted(c.cohort))
            )

        def close_base(rng: random.Random) -> keyholder_pb2.CloseCommitsRequest:
            return keyholder_pb2.CloseCommitsRequest(
                round=rng.choice(list(c.commit_phases)), freeze=rng.random() < 0.5
            )

        methods = self.service.methods_by_name
        return [
            RpcSpec(methods["GetPublicContext"], empty, pools=c.cohort_pools),
            RpcSpec(
                methods["InitializeModel"],
                initialize_base,
                self.judge_initialize,
                pools=c.value_pools,
                concurrency=2,
            ),
            RpcSpec(
                methods["ApplyRound"],
                apply_base,
                nothing_to_apply,  # no round has valid aggregates: nothing may be applied
                pools=c.cohort_pools,
                concurrency=4,
            ),
            RpcSpec(methods["GetModelState"], empty, pools=c.cohort_pools),
            RpcSpec(
                methods["OpenCommits"],
                lambda rng: copy.deepcopy(rng.choice(list(c.open_requests.values()))),
                self.judge_open_commits,
                pools=c.cohort_pools,
            ),
            RpcSpec(
                methods["GetChallenge"],
                challenge_base,
                self.judge_challenge,
                pools=c.cohort_pools,
                check_reply=self.check_challenge,
            ),
            RpcSpec(
                methods["Commit"],
                lambda rng: copy.deepcopy(c.commit_requests[rng.choice(commit_keys)]),
                self.judge_commit,
                pools=c.commit_pools,
                focus={"update": 2.0, "sketches": 2.0},
                mix=(0.03, 0.06, 0.25),  # mostly mutations: they reach the deep checks
                custom=self.mutate_commit,
            ),
            RpcSpec(
                methods["CloseCommits"],
                close_base,
                self.judge_close_commits,
                pools=c.cohort_pools,
                check_reply=self.check_commit_set,
            ),
        ]
