"""The ``Coordinator`` service's RPCs: requests to start from, credentials and oracles.

Registrations with near-miss enrolment tokens and keys, reports of unknown clients or with
impossible privacy spends, each with a credential that is right, missing or slightly wrong.
"""

from __future__ import annotations

import math
import random
from typing import Any

from fedps.proto import coordinator_pb2
from tests.security.fuzz.harness import LEGIT, SKIP, Metadata, RpcSpec, bad, empty
from tests.security.fuzz.service_rpcs import ServiceRpcs
from tests.security.fuzz.values import rand_bytes


class CoordinatorRpcs(ServiceRpcs):
    """The ``Coordinator`` service's RPCs."""

    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]

    def credential_ok(self, client_id: str, metadata: Metadata) -> bool:
        """Whether the call carries ``client_id``'s credential (when credentials exist)."""
        expected = self.cluster.credentials.get(client_id)
        if expected is None:
            return client_id in self.cluster.coord.clients and not self.cluster.credentials
        sent = next((v for k, v in metadata or [] if k == self.cluster.credential_header), "")
        try:
            return bool(expected) and bytes.fromhex(sent) == expected
        except ValueError:
            return False

    def token_pool(self) -> list[str]:
        """Valid tokens and near misses: another name with a valid MAC, a MAC of another
        name, a MAC under another key, case and whitespace changes."""
        if not self.cluster.tokens:
            return []
        valid = list(self.cluster.tokens.values())
        first, second = valid[0], valid[1 % len(valid)]
        name, _, mac = first.rpartition(".")
        other_mac = second.rpartition(".")[2]
        return [
            *valid,
            f"{name}.{other_mac}",
            f"client-7.{mac}",
            f"{name}.{'0' * 64}",
            f"{name}.{mac.upper()}",
            f"{name.upper()}.{mac}",
            f" {first}",
            f"{first}\n",
            f"{name}.{mac}.{mac}",
            f".{mac}",
            name,
        ]

    def judge_register(
        self, msgs: list[coordinator_pb2.RegisterRequest], metadata: Metadata
    ) -> str:
        m = msgs[0]
        if (
            len(m.signing_key) != 32
            or m.num_params != self.cluster.num_params
            or m.num_examples < 1
        ):
            return bad("bad key length, parameter count or example count")
        if not self.cluster.tokens:  # identities not provisioned by token: the old protocol
            known = self.cluster.coord.clients.get(m.client_id) if m.client_id else None
            if known is None:
                return LEGIT  # a new registration
            if known.signing_key != m.signing_key.hex():
                return bad("a known client id with another key")
            return LEGIT if self.credential_ok(m.client_id, metadata) else bad("wrong credential")
        if m.enrolment_token not in self.cluster.tokens.values():
            return bad("no valid enrolment token")
        # A valid re-registration replaces the identity's key and credential: never sent, so
        # the credentials the other RPCs' oracles use stay valid.
        return SKIP

    def judge_report(self, msgs: list[coordinator_pb2.UpdateReport], metadata: Metadata) -> str:
        m = msgs[0]
        if m.client_id in self.cluster.cohort:
            return SKIP  # a cohort member's report would close round 1 early
        if m.client_id not in self.cluster.coord.clients:
            return bad("unknown client")
        if not self.credential_ok(m.client_id, metadata):
            return bad("wrong credential")
        if math.isnan(m.epsilon) or m.epsilon < 0:  # +inf is a client without DP noise
            return bad(f"epsilon {m.epsilon!r} is NaN or negative")
        if not (math.isfinite(m.delta) and 0 <= m.delta < 1):
            return bad(f"delta {m.delta!r} is not in [0, 1)")
        if not m.noise_multiplier >= 0:
            return bad(f"noise multiplier {m.noise_multiplier!r} is NaN or negative")
        return LEGIT

    def judge_remove_shard(
        self, msgs: list[coordinator_pb2.RemoveShardRequest], metadata: Metadata
    ) -> str:
        """Only a shard on the ring can be removed (never the fixture's own: that one is
        skipped, as removing it would end the fixture's rounds)."""
        ring = self.cluster.coord.desk.ring
        if ring is not None and msgs[0].shard_id in ring.view.nodes:
            return SKIP
        return bad("not a shard on the ring")

    def judge_join_shard(
        self, msgs: list[coordinator_pb2.JoinShardRequest], metadata: Metadata
    ) -> str:
        """Only a configured shard off the ring, empty, can join: the fixture's shards are all
        on the ring (any other id is refused; one off it is skipped)."""
        ring = self.cluster.coord.desk.ring
        if ring is not None and msgs[0].shard_id in ring.view.nodes:
            return bad("a shard on the ring already")
        if msgs[0].shard_id in self.cluster.coord.settings.cluster.shard_ids:
            return SKIP
        return bad("not a configured shard")

    def credential_metadata(self, rng: random.Random) -> Metadata:
        """Client ``c``'s credential, missing, random, malformed or slightly wrong."""
        header = self.cluster.credential_header
        cred = self.cluster.credentials.get(self.cluster.ids["c"], b"").hex()
        r = rng.random()
        if r < 0.6 and cred:
            return [(header, cred)]
        if r < 0.7:
            return None
        if r < 0.8:
            return [(header, rand_bytes(rng, 32).hex())]
        if r < 0.85:
            return [(header, rng.choice(["zz", "0", "", "-"]))]
        if r < 0.9:
            return [(header, cred[:-2])]
        if r < 0.95:
            return [(header, cred.upper())]
        return [(header, rand_bytes(rng, 32).hex()), (header, cred)]

    def specs(self) -> list[RpcSpec[Any]]:
        cl = self.cluster
        a, c = cl.ids["a"], cl.ids["c"]
        pools = cl.cohort_pools
        coordinator_pools = {**pools, "client_id": [c, "", "mallory", "client-0", "x" * 1000]}

        def register_base(rng: random.Random) -> coordinator_pb2.RegisterRequest:
            return coordinator_pb2.RegisterRequest(
                name="fuzz",
                num_examples=100,
                num_params=cl.num_params,
                client_id=rng.choice(["", c]),
                signing_key=cl.signers["c"].public_key,
                enrolment_token=cl.tokens.get("c", ""),
            )

        def report_base(rng: random.Random) -> coordinator_pb2.UpdateReport:
            return coordinator_pb2.UpdateReport(
                client_id=c,
                round=cl.round,
                weight=1.0,
                epsilon=1.5,
                delta=1e-5,
                bytes_pushed=70_000,
                budget_exhausted=False,
                noise_multiplier=1.1,
            )

        methods = self.service.methods_by_name
        return [
            RpcSpec(
                methods["Register"],
                register_base,
                self.judge_register,
                metadata=self.credential_metadata,
                pools={
                    **coordinator_pools,
                    "enrolment_token": self.token_pool(),
                    "signing_key": [*pools["signing_key"], cl.signers["c"].public_key],
                },
            ),
            RpcSpec(
                methods["GetTask"],
                lambda rng: coordinator_pb2.TaskRequest(client_id=rng.choice([a, c])),
                metadata=self.credential_metadata,
                pools=pools,
            ),
            RpcSpec(
                methods["ReportUpdate"],
                report_base,
                self.judge_report,
                metadata=self.credential_metadata,
                pools=coordinator_pools,
            ),
            RpcSpec(methods["GetStatus"], empty, pools=pools),
            RpcSpec(
                methods["RemoveShard"],
                lambda rng: coordinator_pb2.RemoveShardRequest(
                    shard_id=rng.choice(["", "shard-9", "x" * 1000])
                ),
                self.judge_remove_shard,
                pools={**pools, "shard_id": ["", "shard-9", "shard-", "x" * 1000]},
            ),
            RpcSpec(
                methods["JoinShard"],
                lambda rng: coordinator_pb2.JoinShardRequest(
                    shard_id=rng.choice(["", "shard-0", "shard-9", "x" * 1000])
                ),
                self.judge_join_shard,
                pools={**pools, "shard_id": ["", "shard-0", "shard-9", "shard-", "x" * 1000]},
            ),
            RpcSpec(
                methods["GetClosedRound"],
                lambda rng: coordinator_pb2.ClosedRoundRequest(round=rng.choice(pools["round"])),
                pools=pools,
            ),
        ]
