"""The ``Shard`` service's RPCs: requests to start from, protocol-aware mutations and oracles.

Pushes of genuine signed updates with one ciphertext corrupted, round 1's ``OpenRound`` with
a commitment replaced, added or renamed, and publishes that break the model's layout, carry
blocks the key holder did not sign or exceed the message limit. Every push that is not a
cohort member's genuine signed update must be refused, and no malformed block may ever reach
the running sums (the cluster's snapshot checks that).
"""

from __future__ import annotations

import copy
import functools
import random
from typing import Any

import numpy as np

from crypto import bitpack
from crypto.signing import is_weak_key, model_verifier
from fedps.proto import shard_pb2
from fedps.rpc.messages import signed_update_from_proto
from tests.security.fuzz.harness import GENUINE, LEGIT, SKIP, Metadata, RpcSpec, bad, empty
from tests.security.fuzz.mutator import Mutator
from tests.security.fuzz.service_rpcs import ServiceRpcs
from tests.security.fuzz.values import flip_bits, mutate_bytes, mutate_str


class ShardRpcs(ServiceRpcs):
    """The ``Shard`` service's RPCs."""

    service = shard_pb2.DESCRIPTOR.services_by_name["Shard"]

    def mutate_push_ciphertext(self, rng: random.Random) -> shard_pb2.PushRequest:
        """A genuine signed push (some of its blocks) with one ciphertext corrupted."""
        cid = rng.choice(sorted(self.cluster.pushes))
        msg = copy.deepcopy(self.cluster.pushes[cid])
        if rng.random() < 0.5:
            keep = sorted(rng.sample(range(len(msg.blocks)), rng.randrange(1, len(msg.blocks) + 1)))
            kept = [copy.deepcopy(msg.blocks[i]) for i in keep]
            del msg.blocks[:]
            msg.blocks.extend(kept)
        target = rng.choice(msg.blocks)
        data, block = target.ciphertext, target.block
        q, bits = self.cluster.public.modulus, self.cluster.public.coeff_bits
        r = rng.random()
        if r < 0.35:
            coeffs = self.cluster.genuine[cid].coeffs[block].copy()
            for _ in range(rng.choice([1, 1, 2, 5])):
                i = rng.randrange(coeffs.size)
                coeffs[i] = rng.choice(
                    [q, q + 1, (1 << bits) - 1, rng.randrange(q, 1 << bits), rng.randrange(q)]
                )
            data = bitpack.pack(coeffs, bits)
        elif r < 0.55:
            data = flip_bits(rng, data, rng.choice([1, 1, 2, 3, 8, 64]))
        elif r < 0.7:
            others = [
                x for g in self.cluster.genuine.values() for x in g.blocks.values() if x != data
            ]
            data = rng.choice(others)
        elif r < 0.8:
            data = rng.choice([data[:-1], data[:-8], data + b"\x00", data + data[:8], data[1:]])
        else:
            data = mutate_bytes(rng, data, self.cluster.cohort_pools["ciphertext"])
        target.ciphertext = data
        if rng.random() < 0.15:
            Mutator(rng, self.cluster.cohort_pools).mutate(msg, 1)
        return msg

    def shard_open_request(self) -> shard_pb2.OpenRoundRequest:
        """Round 1's OpenRound as the coordinator sent it: the committed cohort and updates."""
        return shard_pb2.OpenRoundRequest(
            round=self.cluster.round,
            version=self.cluster.version,
            members=self.cluster.cohort_members,
            context_id=self.cluster.context_id,
            run_id=self.cluster.run_id,
            commitments=[
                self.cluster.commit_requests[(self.cluster.round, c)].update
                for c in sorted(self.cluster.cohort)
            ],
        )

    def mutate_open_round(self, rng: random.Random) -> shard_pb2.OpenRoundRequest:
        """Round 1's OpenRound with a commitment replaced (another round's, a forged one, an
        outsider's), added or renamed, or a member dropped while its commitment stays."""
        msg = self.shard_open_request()
        updates = [
            *(self.cluster.commit_requests[k].update for k in sorted(self.cluster.commit_requests)),
            *self.cluster.forged_updates,
            self.cluster.outsider_update,
        ]
        r = rng.random()
        if r < 0.35:
            msg.commitments[rng.randrange(len(msg.commitments))].CopyFrom(rng.choice(updates))
        elif r < 0.5:
            msg.commitments.add().CopyFrom(rng.choice(updates))
        elif r < 0.65:
            del msg.members[rng.randrange(len(msg.members))]
        elif r < 0.8:
            item = msg.commitments[rng.randrange(len(msg.commitments))]
            item.client_id = mutate_str(rng, item.client_id, self.cluster.cohort_pools["client_id"])
        else:
            Mutator(rng, self.cluster.cohort_pools, {"commitments": 3.0}).mutate(
                msg, rng.choice([1, 2])
            )
        return msg

    def mutate_publish(self, rng: random.Random) -> shard_pb2.PublishRequest:
        """The genuine publish mutated as any request is, or (1 in 50) with a block of more
        values than the servers' message limit takes: gRPC refuses the stream while the
        shard reads it."""
        msg = self.publish_request()
        if rng.random() < 0.02:
            block = msg.blocks[rng.randrange(len(msg.blocks))]
            block.values = bytes(4 * (self.cluster.max_message_bytes // 4))
            return msg
        Mutator(rng, self.cluster.value_pools).mutate(msg, rng.choice([1, 1, 1, 2, 2, 3, 5]))
        return msg

    def publish_request(self) -> shard_pb2.PublishRequest:
        """The publish of the model the shard holds, as the key holder sent it."""
        c = self.cluster
        return shard_pb2.PublishRequest(
            version=c.shard.version,
            num_blocks=c.num_blocks,
            values_per_block=c.n,
            blocks=c.layout_blocks,
        )

    def push_valid(self, m: shard_pb2.PushRequest) -> bool:
        g = self.cluster.genuine.get(m.client_id)
        if g is None:
            return False
        header = (m.round, m.version, m.context_id, m.weight, m.nonce, m.signature, tuple(m.roots))
        if header != g.header or not m.blocks:
            return False
        ids = [b.block for b in m.blocks]
        if len(set(ids)) != len(ids):
            return False
        return all(g.blocks.get(b.block) == b.ciphertext for b in m.blocks)

    def judge_push(self, msgs: list[shard_pb2.PushRequest], metadata: Metadata) -> str:
        if any(self.push_valid(m) for m in msgs):
            return SKIP  # would be accepted (or acknowledged as a duplicate)
        if not msgs:
            return LEGIT  # an empty stream adds nothing
        return bad("not a cohort member's genuine signed update and blocks")

    def judge_open_round(self, msgs: list[shard_pb2.OpenRoundRequest], metadata: Metadata) -> str:
        m = msgs[0]
        members = {x.client_id: bytes(x.signing_key) for x in m.members}
        if not members:
            return bad("empty cohort")
        if any(is_weak_key(k) for k in members.values()):
            return bad("a signing key is not a valid 32-byte Ed25519 key")
        if any(u.client_id not in members for u in m.commitments):
            return bad("a commitment of no cohort member")
        if m.context_id != self.cluster.context_id:
            return bad("unknown context id")
        c = self.cluster
        if m.ring_version > 0:
            return SKIP  # a newer ring: followed (moving blocks), or refused if it is not one
        if (m.round, m.version, m.run_id, members) == (c.round, c.version, c.run_id, c.cohort_keys):
            # (the commitments are compared last: converting them is most of the oracle's work)
            commitments = {u.client_id: signed_update_from_proto(u) for u in m.commitments}
            if commitments == self.genuine_commitments:
                return GENUINE  # round 1 as it is open: a repeat changes nothing
        return SKIP

    @functools.cached_property
    def genuine_commitments(self) -> dict[str, Any]:
        """Round 1's commitments as the cohort made them (the open round's, on the shard)."""
        c = self.cluster
        return {
            cid: signed_update_from_proto(c.commit_requests[(c.round, cid)].update)
            for cid in c.cohort
        }

    def judge_known_round(self, msgs: list[shard_pb2.CloseRoundRequest], metadata: Metadata) -> str:
        return SKIP if msgs[0].round in self.cluster.shard._rounds else bad("unknown round")

    def judge_publish(self, msgs: list[shard_pb2.PublishRequest], metadata: Metadata) -> str:
        if not msgs:
            return bad("empty stream")
        headers = {(m.version, m.num_blocks, m.values_per_block) for m in msgs}
        if len(headers) != 1:
            return bad("messages disagree on the header")
        version, num_blocks, per_block = headers.pop()
        blocks: dict[int, bytes] = {}
        signatures: dict[int, bytes] = {}
        for m in msgs:
            for b in m.blocks:
                if len(b.values) % 4:
                    return bad("values are not float32")
                blocks[b.block] = b.values
                signatures[b.block] = b.signature
        # A model has at least one block of at least one value (the rest mirrors the shard).
        if num_blocks < 1 or per_block < 1:
            return bad(f"num_blocks={num_blocks}, values_per_block={per_block}: an empty model")
        # One shard owns every block (compare sizes first: num_blocks may be huge).
        if len(blocks) != num_blocks or set(blocks) != set(range(num_blocks)):
            return bad("blocks are not exactly the shard's blocks")
        for values in blocks.values():
            v = np.frombuffer(values, dtype="<f4")
            if v.shape != (per_block,) or not np.all(np.isfinite(v)):
                return bad("a block has the wrong size or non-finite values")
        if version < self.cluster.shard.version:
            return bad("older version")
        # The layout holds: only the key holder's signatures make it a publish. Checked with
        # the key holder's own key (not the shard's check), so that a publish of other values,
        # or of this version's values as another version, is sent, and must be refused.
        signed = model_verifier(self.cluster.kh.signer.public_key)
        if not all(signed(version, b, values, signatures[b]) for b, values in blocks.items()):
            return bad("a block the key holder did not sign (for this version)")
        return SKIP

    def specs(self) -> list[RpcSpec[Any]]:
        c = self.cluster
        genuine_pushes = list(c.pushes.values())

        def push_base(rng: random.Random) -> shard_pb2.PushRequest:
            return copy.deepcopy(rng.choice(genuine_pushes))

        def reject_accepted(reply: shard_pb2.PushReply) -> str | None:
            return f"accepted={reply.accepted}" if reply.accepted else None

        def close_base(rng: random.Random) -> shard_pb2.CloseRoundRequest:
            return shard_pb2.CloseRoundRequest(round=c.round)

        methods = self.service.methods_by_name
        return [
            RpcSpec(
                methods["OpenRound"],
                lambda rng: self.shard_open_request(),
                self.judge_open_round,
                pools=c.cohort_pools,
                custom=self.mutate_open_round,
                focus={"commitments": 2.0},
                concurrency=4,
            ),
            RpcSpec(
                methods["PushBlocks"],
                push_base,
                self.judge_push,
                pools=c.cohort_pools,
                focus={"blocks": 4.0, "roots": 1.5},
                check_reply=reject_accepted,
                mix=(0.03, 0.05, 0.2),  # mostly mutations: they reach the deep checks
                custom=self.mutate_push_ciphertext,
            ),
            RpcSpec(
                methods["PullBlocks"],
                lambda rng: shard_pb2.PullRequest(min_version=c.shard.version),
                pools=c.cohort_pools,
            ),
            *(  # closing and discarding a round take the same request and oracle
                RpcSpec(methods[name], close_base, self.judge_known_round, pools=c.cohort_pools)
                for name in ("CloseRound", "DiscardRound")
            ),
            RpcSpec(
                methods["FetchAggregate"],
                lambda rng: shard_pb2.FetchAggregateRequest(
                    round=c.round, contributors=sorted(c.cohort)
                ),
                pools=c.cohort_pools,
            ),
            RpcSpec(
                methods["TraceBlocks"],
                lambda rng: shard_pb2.TraceRequest(
                    round=c.round,
                    blocks=c.shard.owned_blocks[:2],
                    contributors=sorted(c.cohort),
                    challenge_seed=rng.randbytes(32) if rng.random() < 0.5 else b"",
                ),
                pools=c.cohort_pools,
            ),
            RpcSpec(
                methods["Publish"],
                lambda rng: self.publish_request(),
                self.judge_publish,
                pools=c.value_pools,
                custom=self.mutate_publish,
                concurrency=4,
            ),
            RpcSpec(methods["GetStatus"], empty, pools=c.cohort_pools),
        ]
