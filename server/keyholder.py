"""The key holder: the only owner of the secret key, the global model and its optimizer.

It generates the CKKS key pair on first start (secret key in a 0600 file), serves the public
context, and applies rounds: it fetches each shard's encrypted sums and manifests, enforces
the decryption policy (every block an aggregate of at least ``min_cohort`` distinct clients,
each round decrypted at most once), decrypts, divides each block by its manifest's total
weight, applies the server optimizer and publishes the next version of every block to its
shard. It never receives a single client's ciphertext on its own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from crypto import PLAINTEXT_CONTEXT_ID, CkksParams, PlainContext, SecretContext, unpack_blocks
from crypto.release import decryption_error_bound, flood_and_round, released_std
from crypto.secret_context import SECRET_KEY_FILE
from crypto.signing import (
    CHUNKS,
    BlockSigner,
    chunk_commitment,
    model_block_digest,
    verify_proof,
)
from fedps.blocks import BlockLayout
from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    NotReadyError,
    PolicyError,
    RateLimitedError,
)
from fedps.hash_ring import HashRing
from fedps.proto import common_pb2, keyholder_pb2, shard_pb2, shard_pb2_grpc
from fedps.transport import batched, call, create_channel
from server.aggregate_verifier import (
    AggregateVerifier,
    AuditChunk,
    audit_plan,
    chunks_from_proto,
    chunks_to_proto,
)
from server.group_policy import GroupPolicy
from server.record_log import RecordLog
from server.server_optimizer import ServerOptimizer

__all__ = ["MAX_PARAMS", "KeyHolder", "RoundResult"]

_log = logging.getLogger("fedps")

_STATE_FILE = "keyholder-state.npz"
_MAX_AUDITS_PER_CLIENT = 4
MAX_PARAMS = 1 << 31  # about 8 GiB of float32
_CALL_S = 60.0  # deadline of each call to a shard: a restarting shard fails it, then a retry


@dataclass(frozen=True)
class RoundResult:
    """What applying one round produced (cached: a repeated request gets the same result)."""

    round: int
    version: int
    min_contributors: int
    total_weight: float
    update_norm: float
    #: False: a flush that left the synchronous parameter groups as they were
    sync_groups_applied: bool = True
    #: every contributing client with its effective weight (weight x staleness multiplier)
    contributors: dict[str, float] = field(default_factory=dict)
    #: clients whose update reached only some blocks (a shard was down), with those blocks
    partial: dict[str, list[int]] = field(default_factory=dict)


class KeyHolder:
    """Decrypts aggregates only and applies them to the global model.

    Parameters
    ----------
    state_dir
        Where the key pair and the model state live.
    params
        CKKS parameters for a first start.
    shards
        ``{shard_id: address}`` of every shard.
    ring
        The cluster's hash ring.
    optimizer
        The server optimizer.
    min_cohort
        Fewest distinct clients an aggregate must contain to be decrypted.
    groups
        The mixed policy (async mode): values that change only when a round closes.
    """

    def __init__(
        self,
        *,
        state_dir: Path,
        params: CkksParams,
        shards: dict[str, str],
        ring: HashRing,
        optimizer: ServerOptimizer,
        min_cohort: int,
        encrypted: bool = True,
        max_clients: int = 1 << 30,
        max_abs_value: float = 1.0,
        flood_bits: int = 4,
        audit_blocks: int = 16,
        rotate_every_rounds: int = 0,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
        groups: GroupPolicy | None = None,
    ) -> None:
        if min_cohort < 1:
            raise InvalidArgumentError("min_cohort must be at least 1")
        self._dir = state_dir
        secret = state_dir / "keys" / SECRET_KEY_FILE
        if (state_dir / _STATE_FILE).exists() and not secret.exists():
            raise FedPSError(
                f"{secret} is missing but {state_dir / _STATE_FILE} exists: the secret key of "
                "this run is lost, and every ciphertext not yet decrypted with it; start a "
                "new run (docs/operations.md)"
            )
        self.keys = SecretContext.load_or_generate(state_dir / "keys", params)
        self._ring = ring
        self._stubs = {
            sid: shard_pb2_grpc.ShardStub(create_channel(addr)) for sid, addr in shards.items()
        }
        self._optimizer = optimizer
        self.min_cohort = min_cohort
        self.encrypted = encrypted
        self.max_clients = max_clients
        self.max_abs_value = max_abs_value
        self.flood_bits = flood_bits
        self.audit_blocks = audit_blocks
        self.rotate_every_rounds = rotate_every_rounds
        self._staleness = staleness
        self._max_staleness = max_staleness
        self._groups = groups
        self._params_config = params
        self._audit_key = _load_or_create_secret(state_dir / "keys" / "audit.key")
        self.signer = BlockSigner.load_or_create(state_dir / "keys" / "signing.key")
        (state_dir / "keys" / "signing.pub").write_text(self.signer.public_key.hex() + "\n")
        self._audits: dict[int, dict[str, list[dict[int, AuditChunk]]]] = {}
        self._audit_log = RecordLog(state_dir / "audits")  # acknowledged audits survive
        if not encrypted:
            _log.warning("encryption is OFF: updates travel and are summed in plaintext")
        self._lock = threading.Lock()
        self.params: np.ndarray | None = None
        self.version = 0
        self.last_round = 0
        self._released: dict[int, RoundResult] = {}
        self.last_saved = 0.0  # unix time of the last state checkpoint
        self._load_state()
        for round_, payload in self._audit_log.records():
            if round_ > self.last_round:
                submission = keyholder_pb2.AuditSubmission.FromString(payload)
                self._audits.setdefault(round_, {}).setdefault(submission.client_id, []).append(
                    chunks_from_proto(submission.chunks)
                )

    @property
    def layout(self) -> BlockLayout:
        """The model's block layout."""
        if self.params is None:
            raise NotReadyError("the key holder has no model yet")
        return BlockLayout(self.params.size, self.keys.public.params.values_per_block)

    # ------------------------------------------------------------------ model
    def initialize(self, vector: np.ndarray, *, version: int = 0, force: bool = False) -> None:
        """Set the initial model (the chief's job) and publish it.

        If a model exists it is kept and republished: nobody can replace a model through
        this call (a chief restoring a checkpoint into a key holder that lost its state finds
        no model there). ``force`` is accepted for compatibility and changes nothing.
        """
        with self._lock:
            if self.params is not None:
                _log.info("key holder already has model version %d; keeping it", self.version)
                self._publish()
                return
            if vector.ndim != 1 or vector.size == 0 or not np.all(np.isfinite(vector)):
                raise InvalidArgumentError("initial model must be a non-empty finite vector")
            if self._groups is not None:
                self._groups.check(vector.size)
                self._groups.reset()
            before = (self.params, self.version, dict(self._optimizer.state))
            self.params = vector.astype(np.float64)
            self.version = version
            self._optimizer.state.clear()
            try:
                self._publish()
            except Exception:
                # Nothing changes unless every shard took the new model.
                self.params, self.version, self._optimizer.state = before
                raise
            self._save_state()

    # ------------------------------------------------------------------ audits
    def audit_plan(self, round_: int) -> dict[int, int]:
        """The secret ``{block: chunk}`` pairs whose aggregate is checked in ``round_``."""
        if not self.encrypted:
            return {}
        return audit_plan(self._audit_key, round_, self.layout.num_blocks, self.audit_blocks)

    def submit_audit(self, client_id: str, round_: int, chunks: dict[int, AuditChunk]) -> None:
        """Keep a client's planned chunks until the round is applied (checked then)."""
        plan = self.audit_plan(round_)
        if set(chunks) != set(plan) or any(chunks[b].chunk != c for b, c in plan.items()):
            raise InvalidArgumentError("audit chunks do not follow the round's plan")
        public = self.keys.public
        size = public.coeffs_per_block // CHUNKS
        for audit in chunks.values():
            if (
                audit.coefficients.shape != (size,)
                or len(audit.proof) != CHUNKS
                or any(len(h) != 32 for h in audit.proof)
                or int(audit.coefficients.max()) >= public.modulus
                or not verify_proof(
                    audit.coefficients, audit.chunk, audit.proof, chunk_commitment(audit.proof)
                )
            ):
                raise InvalidArgumentError("malformed audit chunk")
        with self._lock:
            if round_ <= self.last_round:
                raise PolicyError(f"round {round_} is already applied")
            # Several submissions per client are kept (a few): at apply time the one matching
            # the client's *signed* root is used, so a forged submission cannot block it.
            per_client = self._audits.setdefault(round_, {}).setdefault(client_id, [])
            if len(per_client) >= _MAX_AUDITS_PER_CLIENT:
                raise RateLimitedError(f"too many audit submissions for {client_id!r}")
            submission = keyholder_pb2.AuditSubmission(
                client_id=client_id, round=round_, chunks=chunks_to_proto(chunks)
            )
            self._audit_log.append(round_, submission.SerializeToString())
            per_client.append(chunks)
            for old in [r for r in self._audits if r < round_ - 2]:
                del self._audits[old]
            self._audit_log.forget_before(round_ - 2)

    # ------------------------------------------------------------------ rounds
    def apply_round(
        self, round_: int, version: int, run_id: str = "", members: dict[str, bytes] | None = None
    ) -> RoundResult:
        """Verify, decrypt and apply round ``round_``'s aggregates; publish the next version.

        Raises
        ------
        PolicyError
            If the decryption policy refuses: an aggregate of fewer than ``min_cohort``
            distinct signed contributors, a contribution that is not signed by a cohort member,
            a tampered aggregate, a missing block, an out-of-bounds result, or a round that does
            not follow the current version. A round already applied returns its released
            result again, never a fresh decryption.
        """
        with self._lock:
            cached = self._released.get(round_)
            if cached is not None:
                if round_ == self.last_round:
                    self._publish()  # the first attempt may have died before publishing
                return cached
            if self.params is None:
                raise NotReadyError("the key holder has no model yet")
            if version != self.version:
                raise PolicyError(
                    f"round {round_} trained version {version}, the model is at {self.version}"
                )
            if round_ <= self.last_round:
                raise PolicyError(f"round {round_} is not after the last applied round")
            verifier = AggregateVerifier(
                run_id=run_id,
                round_=round_,
                context_id=self.context_id,
                members=members or {},
                min_cohort=self.min_cohort,
                max_clients=self.max_clients,
                version=self.version,
                staleness=self._staleness,
                max_staleness=self._max_staleness,
            )
            layout = self.layout
            delta, manifests = self._decrypt_average(round_, layout, verifier)
            round_closed = True
            if self._groups is None:
                self.params = self._optimizer.step(self.params, delta)
            else:  # the weight behind each value: its block's total
                n = layout.values_per_block
                totals = {b: np.full(n, sum(m.values())) for b, m in manifests.items()}
                self.params, round_closed = self._groups.apply(
                    self._optimizer, self.params, delta, layout.join(totals)
                )
            self.version += 1
            self.last_round = round_
            result = RoundResult(
                round=round_,
                version=self.version,
                min_contributors=min(len(m) for m in manifests.values()),
                total_weight=sum(manifests[0].values()),
                update_norm=float(np.linalg.norm(delta)),
                sync_groups_applied=round_closed,
                contributors={c: w for m in manifests.values() for c, w in m.items()},
                partial=_partial(manifests),
            )
            self._released[round_] = result
            self._audits.pop(round_, None)
            if self.rotate_every_rounds and round_ % self.rotate_every_rounds == 0:
                self._rotate_keys()
            self._save_state()
            self._publish()
            _log.info(
                "applied round %d (%d+ contributors), published version %d",
                round_,
                result.min_contributors,
                self.version,
            )
            return result

    def _rotate_keys(self) -> None:
        """Replace the key pair: later rounds encrypt under a new context, old keys are gone."""
        keys = SecretContext.generate(self._params_config)
        keys.save(self._dir / "keys")
        self.keys = keys
        _log.info("rotated the CKKS keys; new context %s", keys.public.context_id[:12])

    def _fetch(self, round_: int) -> list[shard_pb2.FetchAggregateReply]:
        replies: list[shard_pb2.FetchAggregateReply] = []
        for sid, stub in self._stubs.items():
            request = shard_pb2.FetchAggregateRequest(round=round_)
            got = call(
                lambda: list(stub.FetchAggregate(request, timeout=_CALL_S)),  # noqa: B023
                f"fetch from {sid}",
            )
            for reply in got:
                for agg in reply.blocks:
                    if self._ring.owner(agg.block) != sid:
                        raise PolicyError(f"{sid} sent block {agg.block}, which it does not own")
            replies.extend(got)
        return replies

    def _decrypt_average(
        self, round_: int, layout: BlockLayout, verifier: AggregateVerifier
    ) -> tuple[np.ndarray, dict[int, dict[str, float]]]:
        """The round's weighted average update and each block's contributors with their
        effective weights (weight x staleness multiplier; a block's total is their sum)."""
        replies = self._fetch(round_)
        for reply in replies:
            for update in reply.updates:
                verifier.add_update(update)
        plan = self.audit_plan(round_)
        audits = self._audits.get(round_, {})
        averaged: dict[int, np.ndarray] = {}
        manifests: dict[int, dict[str, float]] = {}
        aggregates = [agg for reply in replies for agg in reply.blocks]
        # Validate and unpack every aggregate at once (one vectorised pass, not one per block).
        rows = self._unpack([agg.ciphertext for agg in aggregates])
        for agg, row in zip(aggregates, rows, strict=True):
            if not 0 <= agg.block < layout.num_blocks or agg.block in averaged:
                raise PolicyError(f"block {agg.block} is out of range or aggregated twice")
            weights, multipliers = verifier.check_manifest(agg)
            if agg.block in plan and self.encrypted:
                chunk = plan[agg.block]
                roots = {c.client_id: c.root for c in agg.contributions}
                per_client = {}
                for client, subs in audits.items():
                    found = _matching(subs, agg.block, roots.get(client, b""))
                    if found is not None:
                        per_client[client] = found
                verifier.check_chunk(self.keys.public, agg, row, chunk, per_client, multipliers)
            # Clients weighted their updates; shards multiplied by staleness weights.
            manifests[agg.block] = {c: w * multipliers[c] for c, w in weights.items()}
            try:
                opened = self.keys.decrypt(row) if self.encrypted else row
            except InvalidArgumentError as exc:
                raise PolicyError(f"block {agg.block} cannot be decrypted: {exc}") from exc
            summed = self._release(opened, sum(multipliers.values()), agg.block)
            averaged[agg.block] = summed / sum(manifests[agg.block].values())
        missing = sorted(set(range(layout.num_blocks)) - set(averaged))
        if missing:
            raise PolicyError(f"round {round_}: no aggregate for blocks {missing[:10]}")
        return layout.join(averaged), manifests

    def _release(self, summed: np.ndarray, contributors: int, block: int) -> np.ndarray:
        """Flood and round a decrypted sum, then refuse it if it breaks the clipping bound."""
        margin = 0.0
        if self.encrypted and self.flood_bits > 0:
            sigma = 2.0**self.flood_bits * decryption_error_bound(
                self.keys.public.params, contributors
            )
            summed = flood_and_round(summed, sigma)
            margin = 8 * released_std(sigma)
        bound = contributors * self.max_abs_value * (1 + 1e-6) + margin
        worst = float(np.abs(summed).max())
        if worst > bound:
            raise PolicyError(
                f"block {block}: decrypted sum reaches {worst:.4g}, beyond the {bound:.4g} that "
                f"{contributors} clients clipped to {self.max_abs_value:g} allow; refusing to apply"
            )
        return summed

    @property
    def context_id(self) -> str:
        """The id clients must encrypt under (or the plaintext id, encryption off)."""
        return self.keys.public.context_id if self.encrypted else PLAINTEXT_CONTEXT_ID

    def _unpack(self, data: list[bytes]) -> np.ndarray:
        """Validated coefficients of aggregate blocks (values, encryption off)."""
        if not self.encrypted:
            return PlainContext(self.keys.public.params.values_per_block).unpack_blocks(data)
        return unpack_blocks(self.keys.public, data)

    def _publish(self) -> None:
        assert self.params is not None
        layout = self.layout
        n = layout.values_per_block
        per_shard: dict[str, list[common_pb2.ParameterBlock]] = {s: [] for s in self._stubs}
        for b in range(layout.num_blocks):
            values = layout.block_of(self.params, b).astype("<f4").tobytes()
            signature = self.signer.sign(model_block_digest(self.version, b, values))
            per_shard[self._ring.owner(b)].append(
                common_pb2.ParameterBlock(
                    block=b, version=self.version, values=values, signature=signature
                )
            )
        for sid, blocks in per_shard.items():
            messages = [
                shard_pb2.PublishRequest(
                    version=self.version,
                    num_blocks=layout.num_blocks,
                    values_per_block=n,
                    blocks=batch,
                )
                for batch in batched(blocks, lambda p: len(p.values))
            ] or [
                shard_pb2.PublishRequest(
                    version=self.version, num_blocks=layout.num_blocks, values_per_block=n
                )
            ]
            stub = self._stubs[sid]
            call(lambda: stub.Publish(iter(messages), timeout=_CALL_S), f"publish to {sid}")  # noqa: B023

    # ------------------------------------------------------------------ durability
    def _save_state(self) -> None:
        assert self.params is not None
        path = self._dir / _STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        meta = {
            "version": self.version,
            "last_round": self.last_round,
            "released": {str(k): asdict(v) for k, v in self._released.items()},
        }
        arrays: dict[str, np.ndarray] = {
            "params": self.params,
            "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        }
        arrays.update({f"opt_{k}": v for k, v in self._optimizer.state.items()})
        if self._groups is not None:
            arrays.update({f"groups_{k}": v for k, v in self._groups.state().items()})
        with open(tmp, "wb") as fh:
            np.savez(fh, *[], **arrays)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.last_saved = time.time()

    def _load_state(self) -> None:
        path = self._dir / _STATE_FILE
        if not path.exists():
            return
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            self.params = data["params"]
            self._optimizer.state = {k[4:]: data[k] for k in data.files if k.startswith("opt_")}
            if self._groups is not None:
                groups = {k[7:]: data[k] for k in data.files if k.startswith("groups_")}
                self._groups.load(groups)
        self.version = int(meta["version"])
        self.last_round = int(meta["last_round"])
        self._released = {int(k): RoundResult(**v) for k, v in meta["released"].items()}
        self.last_saved = path.stat().st_mtime
        _log.info("key holder resumed at version %d (round %d)", self.version, self.last_round)


def _partial(manifests: dict[int, dict[str, float]]) -> dict[str, list[int]]:
    """Clients missing from some blocks, with the blocks they are in."""
    everyone = {c for m in manifests.values() for c in m}
    partial = {c: sorted(b for b, m in manifests.items() if c in m) for c in everyone}
    return {c: blocks for c, blocks in partial.items() if len(blocks) < len(manifests)}


def _load_or_create_secret(path: Path) -> bytes:
    """A 32-byte secret kept in a 0600 file (created on first use)."""
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    return secret


def _matching(
    submissions: list[dict[int, AuditChunk]], block: int, root: bytes
) -> AuditChunk | None:
    """The submitted chunk of ``block`` that proves against the client's signed ``root``."""
    for chunks in submissions:
        audit = chunks.get(block)
        if audit is not None and chunk_commitment(audit.proof) == root:
            return audit
    return None
