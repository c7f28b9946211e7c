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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from crypto import PLAINTEXT_CONTEXT_ID, CkksParams, PlainContext, SecretContext, unpack_block
from fedps.blocks import BlockLayout
from fedps.errors import InvalidArgumentError, NotReadyError, PolicyError
from fedps.hash_ring import HashRing
from fedps.proto import common_pb2, shard_pb2, shard_pb2_grpc
from fedps.transport import batched, call, create_channel
from server.server_optimizer import ServerOptimizer

__all__ = ["KeyHolder", "RoundResult"]

_log = logging.getLogger("fedps")

_STATE_FILE = "keyholder-state.npz"


@dataclass(frozen=True)
class RoundResult:
    """What applying one round produced (cached: a repeated request gets the same result)."""

    round: int
    version: int
    min_contributors: int
    total_weight: float
    update_norm: float


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
    ) -> None:
        if min_cohort < 1:
            raise InvalidArgumentError("min_cohort must be at least 1")
        self._dir = state_dir
        self.keys = SecretContext.load_or_generate(state_dir / "keys", params)
        self._ring = ring
        self._stubs = {
            sid: shard_pb2_grpc.ShardStub(create_channel(addr)) for sid, addr in shards.items()
        }
        self._optimizer = optimizer
        self.min_cohort = min_cohort
        self.encrypted = encrypted
        self.max_clients = max_clients
        if not encrypted:
            _log.warning("encryption is OFF: updates travel and are summed in plaintext")
        self._lock = threading.Lock()
        self.params: np.ndarray | None = None
        self.version = 0
        self.last_round = 0
        self._released: dict[int, RoundResult] = {}
        self._load_state()

    @property
    def layout(self) -> BlockLayout:
        """The model's block layout."""
        if self.params is None:
            raise NotReadyError("the key holder has no model yet")
        return BlockLayout(self.params.size, self.keys.public.params.values_per_block)

    # ------------------------------------------------------------------ model
    def initialize(self, vector: np.ndarray, *, version: int = 0, force: bool = False) -> None:
        """Set the initial model (the chief's job) and publish it; no-op if one exists."""
        with self._lock:
            if self.params is not None and not force:
                _log.info("key holder already has model version %d; keeping it", self.version)
                self._publish()
                return
            if vector.ndim != 1 or vector.size == 0 or not np.all(np.isfinite(vector)):
                raise InvalidArgumentError("initial model must be a non-empty finite vector")
            self.params = vector.astype(np.float64)
            self.version = version
            self._optimizer.state.clear()
            self._save_state()
            self._publish()

    def apply_round(self, round_: int, version: int) -> RoundResult:
        """Decrypt round ``round_``'s aggregates, apply them, publish the next version.

        Raises
        ------
        PolicyError
            If an aggregate has fewer than ``min_cohort`` distinct contributors, a block is
            missing, or the round does not follow the current version.
        """
        with self._lock:
            cached = self._released.get(round_)
            if cached is not None:
                return cached
            if self.params is None:
                raise NotReadyError("the key holder has no model yet")
            if version != self.version:
                raise PolicyError(
                    f"round {round_} trained version {version}, the model is at {self.version}"
                )
            if round_ <= self.last_round:
                raise PolicyError(f"round {round_} is not after the last applied round")
            layout = self.layout
            delta, min_contrib, weight0 = self._decrypt_average(round_, layout)
            self.params = self._optimizer.step(self.params, delta)
            self.version += 1
            self.last_round = round_
            result = RoundResult(
                round=round_,
                version=self.version,
                min_contributors=min_contrib,
                total_weight=weight0,
                update_norm=float(np.linalg.norm(delta)),
            )
            self._released = {round_: result}
            self._save_state()
            self._publish()
            _log.info(
                "applied round %d (%d+ contributors), published version %d",
                round_,
                min_contrib,
                self.version,
            )
            return result

    def _decrypt_average(self, round_: int, layout: BlockLayout) -> tuple[np.ndarray, int, float]:
        averaged: dict[int, np.ndarray] = {}
        min_contrib = 1 << 30
        weight0 = 0.0
        for sid, stub in self._stubs.items():
            request = shard_pb2.FetchAggregateRequest(round=round_)
            replies = call(lambda: list(stub.FetchAggregate(request)), f"fetch from {sid}")  # noqa: B023
            for reply in replies:
                for agg in reply.blocks:
                    self._check_aggregate(sid, agg, layout, averaged)
                    weights = {c.client_id: c.weight for c in agg.contributions}
                    total = float(sum(weights.values()))
                    averaged[agg.block] = self._open(agg.ciphertext) / total
                    min_contrib = min(min_contrib, len(weights))
                    if agg.block == 0:
                        weight0 = total
        missing = sorted(set(range(layout.num_blocks)) - set(averaged))
        if missing:
            raise PolicyError(f"round {round_}: no aggregate for blocks {missing[:10]}")
        return layout.join(averaged), min_contrib, weight0

    @property
    def context_id(self) -> str:
        """The id clients must encrypt under (or the plaintext id, encryption off)."""
        return self.keys.public.context_id if self.encrypted else PLAINTEXT_CONTEXT_ID

    def _open(self, data: bytes) -> np.ndarray:
        """Decrypt one aggregate block (or read it, encryption off)."""
        if not self.encrypted:
            plain = PlainContext(self.keys.public.params.values_per_block)
            values: np.ndarray = plain.unpack_blocks([data])[0]
            return values
        return self.keys.decrypt(unpack_block(self.keys.public, data))

    def _check_aggregate(
        self,
        sid: str,
        agg: common_pb2.AggregateBlock,
        layout: BlockLayout,
        seen: dict[int, np.ndarray],
    ) -> None:
        if not 0 <= agg.block < layout.num_blocks or self._ring.owner(agg.block) != sid:
            raise PolicyError(f"{sid} sent block {agg.block}, which it does not own")
        if agg.block in seen:
            raise PolicyError(f"block {agg.block} aggregated twice")
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
        if not all(np.isfinite(c.weight) and c.weight > 0 for c in agg.contributions):
            raise PolicyError(f"block {agg.block}: invalid weights")

    def _publish(self) -> None:
        assert self.params is not None
        layout = self.layout
        n = layout.values_per_block
        per_shard: dict[str, list[common_pb2.ParameterBlock]] = {s: [] for s in self._stubs}
        for b in range(layout.num_blocks):
            values = layout.block_of(self.params, b).astype("<f4").tobytes()
            per_shard[self._ring.owner(b)].append(
                common_pb2.ParameterBlock(block=b, version=self.version, values=values)
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
            call(lambda: stub.Publish(iter(messages)), f"publish to {sid}")  # noqa: B023

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
        with open(tmp, "wb") as fh:
            np.savez(fh, *[], **arrays)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def _load_state(self) -> None:
        path = self._dir / _STATE_FILE
        if not path.exists():
            return
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            self.params = data["params"]
            self._optimizer.state = {k[4:]: data[k] for k in data.files if k.startswith("opt_")}
        self.version = int(meta["version"])
        self.last_round = int(meta["last_round"])
        self._released = {int(k): RoundResult(**v) for k, v in meta["released"].items()}
        _log.info("key holder resumed at version %d (round %d)", self.version, self.last_round)
