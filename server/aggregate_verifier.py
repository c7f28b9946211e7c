"""The key holder's checks on what a shard hands it, before anything is decrypted.

For each block aggregate the verifier checks that every listed contribution belongs to a
cohort member whose Ed25519 signature over its whole update verifies, with the same weight
and the same committed root as the manifest says, that no client is counted twice, that the
aggregate has at least ``min_cohort`` and at most ``max_clients`` contributors, and, for the
round's secretly planned (block, chunk) pairs, that the aggregate's chunk equals the sum
modulo q of the chunks the contributors sent the key holder directly (each proven against
its signed root). A shard that isolates one client (decrypt just its ciphertext), scales a
ciphertext, drops or invents contributions, or re-weights one, is caught: see
docs/security.md for the detection probability of the chunk check.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from crypto import PublicContext
from crypto.signing import CHUNKS, update_digest, verify_block, verify_proof
from fedps.errors import InvalidArgumentError, PolicyError
from fedps.proto import common_pb2, keyholder_pb2
from server.staleness import multiplier

__all__ = [
    "AggregateVerifier",
    "AuditChunk",
    "audit_plan",
    "chunks_from_proto",
    "chunks_to_proto",
]


@dataclass(frozen=True)
class AuditChunk:
    """One chunk of one client's ciphertext, sent to the key holder for the check."""

    chunk: int
    coefficients: np.ndarray
    proof: list[bytes]


def chunks_from_proto(items: Iterable[keyholder_pb2.AuditChunk]) -> dict[int, AuditChunk]:
    """A submission's chunks by block (shapes are checked by the key holder).

    Raises
    ------
    InvalidArgumentError
        If a block appears twice or coefficients are not whole 64-bit words.
    """
    chunks: dict[int, AuditChunk] = {}
    for item in items:
        if item.block in chunks or len(item.coefficients) % 8:
            raise InvalidArgumentError("malformed audit submission")
        chunks[item.block] = AuditChunk(
            chunk=item.chunk,
            coefficients=np.frombuffer(item.coefficients, dtype="<u8").astype(np.uint64),
            proof=list(item.proof),
        )
    return chunks


def chunks_to_proto(chunks: dict[int, AuditChunk]) -> list[keyholder_pb2.AuditChunk]:
    """The inverse of :func:`chunks_from_proto`."""
    return [
        keyholder_pb2.AuditChunk(
            block=block,
            chunk=audit.chunk,
            coefficients=audit.coefficients.astype("<u8").tobytes(),
            proof=audit.proof,
        )
        for block, audit in sorted(chunks.items())
    ]


def audit_plan(key: bytes, round_: int, num_blocks: int, audit_blocks: int) -> dict[int, int]:
    """The secret ``{block: chunk}`` pairs checked in ``round_`` (HMAC-derived, stable)."""
    seed = hmac.new(key, b"audit" + struct.pack("<Q", round_), hashlib.sha256).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    count = min(num_blocks, audit_blocks)
    blocks = rng.choice(num_blocks, size=count, replace=False)
    chunks = rng.integers(0, CHUNKS, size=count)
    return {int(b): int(c) for b, c in zip(blocks, chunks, strict=True)}


class AggregateVerifier:
    """Checks one round's aggregates against signatures and the clients' audit chunks."""

    def __init__(
        self,
        *,
        run_id: str,
        round_: int,
        context_id: str,
        members: dict[str, bytes],
        min_cohort: int,
        max_clients: int,
        version: int = 0,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
    ) -> None:
        self.run_id = run_id
        self.round = round_
        self.context_id = context_id
        self.members = members
        self.min_cohort = min_cohort
        self.max_clients = max_clients
        self.version = version
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.updates: dict[str, common_pb2.SignedUpdate] = {}

    def add_update(self, update: common_pb2.SignedUpdate) -> None:
        """Verify and remember one client's signed update (from any shard)."""
        key = self.members.get(update.client_id)
        if key is None:
            raise PolicyError(f"{update.client_id!r} is not in the cohort of round {self.round}")
        digest = update_digest(
            run_id=self.run_id,
            round_=self.round,
            client_id=update.client_id,
            context_id=self.context_id,
            weight=update.weight,
            nonce=update.nonce,
            roots=list(update.roots),
            version=update.version,
        )
        if not verify_block(key, digest, update.signature):
            raise PolicyError(f"the signature of {update.client_id!r} does not verify")
        known = self.updates.get(update.client_id)
        if known is not None and known.SerializeToString() != update.SerializeToString():
            raise PolicyError(f"two different updates of {update.client_id!r} in one round")
        self.updates[update.client_id] = update

    def check_manifest(
        self, agg: common_pb2.AggregateBlock
    ) -> tuple[dict[str, float], dict[str, int]]:
        """Check one block's manifest; returns ``{client: weight}`` and the staleness
        multipliers ``{client: m}`` (all 1 in sync mode), recomputed, not trusted."""
        ids = [c.client_id for c in agg.contributions]
        if len(set(ids)) != len(ids):
            raise PolicyError(f"block {agg.block}: a client is counted twice")
        if len(ids) < self.min_cohort:
            raise PolicyError(
                f"block {agg.block}: {len(ids)} contributors, policy needs at least "
                f"{self.min_cohort}; refusing to decrypt"
            )
        if len(ids) > self.max_clients:
            raise PolicyError(
                f"block {agg.block}: {len(ids)} contributors, but the CKKS parameters are "
                f"sized for at most {self.max_clients} (he.max_clients); the sum may have wrapped"
            )
        weights: dict[str, float] = {}
        multipliers: dict[str, int] = {}
        for c in agg.contributions:
            multipliers[c.client_id] = self._expected_multiplier(agg.block, c)
            update = self.updates.get(c.client_id)
            if update is None:
                raise PolicyError(f"block {agg.block}: no signed update from {c.client_id!r}")
            if agg.block >= len(update.roots) or update.roots[agg.block] != c.root:
                raise PolicyError(
                    f"block {agg.block}: {c.client_id!r}'s root is not the signed one"
                )
            if c.weight != update.weight or not (np.isfinite(c.weight) and c.weight > 0):
                raise PolicyError(f"block {agg.block}: {c.client_id!r}'s weight was altered")
            if update.version != c.version:
                raise PolicyError(f"block {agg.block}: {c.client_id!r}'s version was altered")
            weights[c.client_id] = c.weight
        return weights, multipliers

    def _expected_multiplier(self, block: int, c: common_pb2.Contribution) -> int:
        if self.staleness is None:
            expected, age = 1, 0
            if c.version != self.version:
                raise PolicyError(f"block {block}: {c.client_id!r} trained another version")
        else:
            age = self.version - c.version
            if not 0 <= age <= self.max_staleness:
                raise PolicyError(f"block {block}: {c.client_id!r}'s update is too stale")
            expected = multiplier(self.staleness, age)
        if c.multiplier != expected:
            raise PolicyError(
                f"block {block}: {c.client_id!r} weighted by {c.multiplier}, staleness {age} "
                f"gives {expected}"
            )
        return expected

    def check_chunk(
        self,
        public: PublicContext,
        agg: common_pb2.AggregateBlock,
        coefficients: np.ndarray,
        chunk: int,
        audits: dict[str, AuditChunk],
        multipliers: dict[str, int] | None = None,
    ) -> None:
        """The aggregate's ``chunk`` must equal the sum of the contributors' chunks mod q.

        ``coefficients`` are the aggregate's validated coefficients."""
        q = np.uint64(public.modulus)
        size = public.coeffs_per_block // CHUNKS
        total = np.zeros(size, dtype=np.uint64)
        for c in agg.contributions:
            audit = audits.get(c.client_id)
            if audit is None or audit.chunk != chunk:
                raise PolicyError(f"block {agg.block}: no audit chunk from {c.client_id!r}")
            if audit.coefficients.shape != (size,) or not verify_proof(
                audit.coefficients, chunk, audit.proof, c.root
            ):
                raise PolicyError(
                    f"block {agg.block}: {c.client_id!r}'s audit chunk is not its own"
                )
            if int(audit.coefficients.max()) >= public.modulus:
                raise PolicyError(f"block {agg.block}: audit chunk out of range")
            m = np.uint64((multipliers or {}).get(c.client_id, 1))
            total = (total + (audit.coefficients * m) % q) % q
        aggregate = coefficients[chunk * size : (chunk + 1) * size]
        if not np.array_equal(aggregate, total):
            raise PolicyError(
                f"block {agg.block}: the aggregate is not the sum of its signed contributions "
                "(shard tampering detected); refusing to decrypt"
            )
