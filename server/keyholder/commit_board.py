"""Commit before reveal: the key holder's record of what each contributor committed to.

A round (or async buffer) has a commit phase before any ciphertext of it may reach a shard:

1. The coordinator opens it with the cohort (client ids and Ed25519 keys) and the model
   version (:meth:`CommitBoard.open`).
2. Each cohort client asks for the round's secret challenge seed
   (:meth:`CommitBoard.challenge_seed`), and commits: its signed update (the root of every
   encrypted block, its weight, nonce and trained version) with the linear sketches of its
   ciphertexts under the challenge (:meth:`CommitBoard.commit`).
3. The coordinator freezes the phase (:meth:`CommitBoard.close`); only then does it open the
   round on the shards, for exactly the committed clients, and only then do clients push.

So no contributor's ciphertext can depend on another's of the same round: everything a shard
could show a colluding client arrives after every commitment is fixed here, and a commitment
that comes later is refused. The key holder later checks the aggregates against exactly these
commitments (:class:`~.aggregate_verifier.AggregateVerifier`). Every accepted change is
logged durably before it is acknowledged (:class:`~.commit_log.CommitLog`), so a restarted
key holder keeps what it acknowledged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crypto.signed_update import SignedUpdate
from crypto.signing import is_weak_key
from fedps.errors import (
    InvalidArgumentError,
    PolicyError,
    RoundClosedError,
    UnknownClientError,
)
from fedps.rpc.keyholder_messages import CommitClosing, CommitOpening, UpdateCommitment
from fedps.sharding.sparse_mask import mask_seed
from server.keyholder.commit_log import CommitLog, CommitRecord

__all__ = ["CommitBoard", "CommitPhase", "Commitment"]

_log = logging.getLogger("fedps")
_ROOT_BYTES = 32
_KEEP_ROUNDS = 2  # phases kept before the newest (a late apply of the previous round)
_MAX_ID = 256  # characters of a client id (error messages quote it)


@dataclass(frozen=True)
class Commitment:
    """One client's commitment: its signed update and its ciphertexts' sketches."""

    update: SignedUpdate
    sketches: np.ndarray  # uint64, (sketch count, blocks); empty without encryption


@dataclass
class CommitPhase:
    """One round's cohort and the commitments it accepted."""

    round: int
    version: int
    run_id: str
    context_id: str
    members: dict[str, bytes]  # client id -> Ed25519 public key
    commitments: dict[str, Commitment] = field(default_factory=dict)
    frozen: bool = False


class CommitBoard:
    """The commit phases of the key holder (gRPC-free).

    Parameters
    ----------
    directory
        Where the commitment log lives.
    secret
        32 bytes only the key holder knows; each round's challenge seed is derived from it.
    num_blocks
        Blocks of an update (every commitment has one root and one sketch per block): the
        model's, or the blocks a sparsified update sends.
    modulus
        The ciphertext modulus q (sketches are below it); 0 without encryption.
    sketch_count
        Sketches per block (0 without encryption).
    max_staleness
        How many versions older than the round's a committed update may be (0: sync).
    weight_bounds
        The closed range every declared aggregation weight must lie in.
    fsync
        Flush every record of the commitment log to disk before it is acknowledged.
    masked
        Updates are sparsified (:mod:`fedps.sharding.sparse_mask`): every commitment ends with
        one more root, its round's mask seed (:meth:`mask_seed`).
    """

    def __init__(
        self,
        directory: Path,
        *,
        secret: bytes,
        num_blocks: int,
        modulus: int,
        sketch_count: int,
        max_staleness: int = 0,
        weight_bounds: tuple[float, float] = (1.0, 1.0),
        fsync: bool = True,
        masked: bool = False,
    ) -> None:
        self._secret = secret
        self.masked = masked
        self.num_blocks = num_blocks
        self.modulus = modulus
        self.sketch_count = sketch_count
        self.max_staleness = max_staleness
        self.weight_bounds = weight_bounds
        self._lock = threading.Lock()
        self._excluded: dict[str, str] = {}  # client -> why it was blamed
        self._phases: dict[int, CommitPhase] = {}
        self._log = CommitLog(directory, fsync=fsync)
        self._replaying = True
        try:
            for record in self._log.records():
                self._replay(record)
        finally:
            self._replaying = False

    def _replay(self, record: CommitRecord) -> None:
        if isinstance(record, CommitOpening):
            o = record
            self.open(o.round, o.version, o.run_id, o.context_id, o.members)
        elif isinstance(record, UpdateCommitment):
            self.commit(record.round, record.update, record.sketches)
        else:
            self.close(record.round, freeze=record.freeze)

    def _append(self, record: CommitRecord) -> None:
        if not self._replaying:
            self._log.append(record)

    # ------------------------------------------------------------------ phases
    def open(
        self,
        round_: int,
        version: int,
        run_id: str,
        context_id: str,
        members: dict[str, bytes],
    ) -> None:
        """Start collecting commitments of ``members`` for ``round_`` (idempotent).

        Raises
        ------
        InvalidArgumentError
            An empty cohort or a weak signing key.
        RoundClosedError
            ``round_`` was frozen with another cohort: its ciphertexts may have been shown
            around, so it can never take new commitments (open a new round instead).
        """
        if not members:
            raise InvalidArgumentError("a round needs a non-empty cohort")
        if any(is_weak_key(key) for key in members.values()):
            raise InvalidArgumentError("every cohort member needs a valid 32-byte Ed25519 key")
        with self._lock:
            existing = self._phases.get(round_)
            same = existing is not None and (
                existing.version,
                existing.run_id,
                existing.context_id,
                existing.members,
            ) == (version, run_id, context_id, members)
            if same:
                return
            if existing is not None and existing.frozen:
                raise RoundClosedError(
                    f"round {round_}'s commitments are closed; it cannot be opened again "
                    "with another cohort"
                )
            self._append(CommitOpening(round_, version, run_id, context_id, members))
            # A coordinator that restarted in the commit phase opens it afresh.
            self._phases[round_] = CommitPhase(round_, version, run_id, context_id, dict(members))
            for old in [r for r in self._phases if r < round_ - _KEEP_ROUNDS]:
                del self._phases[old]
            if not self._replaying:
                self._log.forget_before(round_ - _KEEP_ROUNDS)

    def challenge_seed(self, round_: int, client_id: str) -> bytes:
        """The secret challenge seed of ``round_``, for one of its cohort members only."""
        with self._lock:
            return self._seed(self._member_phase(round_, client_id))

    def pad_seed(self, round_: int, client_id: str) -> bytes:
        """``client_id``'s pad seed of ``round_`` (:mod:`crypto.blinding`): only it gets it."""
        with self._lock:
            return self._pad_seed(self._member_phase(round_, client_id), client_id)

    def pad_seeds(self, round_: int) -> dict[str, bytes]:
        """Every cohort member's pad seed of ``round_``, excluded or not (the key holder's)."""
        with self._lock:
            phase = self._require(round_)
            return {client: self._pad_seed(phase, client) for client in phase.members}

    def _pad_seed(self, phase: CommitPhase, client_id: str) -> bytes:
        """HMAC of the client's id and the phase's challenge seed (a seed per round and client)."""
        message = b"fedps-pad-v1" + struct.pack("<I", len(client_id)) + client_id.encode()
        return hmac.new(self._secret, message + self._seed(phase), hashlib.sha256).digest()

    def seed(self, round_: int) -> bytes:
        """The challenge seed of ``round_`` (the key holder's own use)."""
        with self._lock:
            return self._seed(self._require(round_))

    def mask_seed(self, round_: int) -> bytes:
        """The mask seed of ``round_``'s sparsified updates (derived from its challenge seed)."""
        return mask_seed(self.seed(round_))

    def _seed(self, phase: CommitPhase) -> bytes:
        """HMAC of everything that defines the phase.

        A round reopened for another cohort, version or key generation gets another challenge.
        """
        h = hashlib.sha256()
        for part in [phase.run_id.encode(), phase.context_id.encode()]:
            h.update(struct.pack("<I", len(part)) + part)
        for client, key in sorted(phase.members.items()):
            h.update(struct.pack("<I", len(client)) + client.encode() + key)
        message = b"fedps-challenge-v2" + struct.pack("<QQ", phase.round, phase.version)
        return hmac.new(self._secret, message + h.digest(), hashlib.sha256).digest()

    def commit(self, round_: int, update: SignedUpdate, sketches: bytes) -> None:
        """Accept one cohort member's commitment while the phase is open (idempotent).

        Raises
        ------
        RoundClosedError
            The phase is unknown or frozen (the commitment came too late).
        UnknownClientError
            The client is not in the cohort.
        InvalidArgumentError
            A bad signature, root, weight, version or sketch, or a second, different
            commitment from the same client.
        """
        client_id = update.client_id
        with self._lock:
            phase = self._member_phase(round_, client_id)
            known = phase.commitments.get(client_id)
            if known is not None:
                if known.update == update and known.sketches.astype("<u8").tobytes() == sketches:
                    return  # a retry after a lost acknowledgement
                raise InvalidArgumentError(
                    f"{client_id!r} already committed another update to round {round_}"
                )
            if phase.frozen:
                raise RoundClosedError(
                    f"round {round_}'s commitments are closed: {client_id!r} committed too late"
                )
            if self._replaying:  # checked when it was accepted; the config may have changed
                values = np.frombuffer(sketches, dtype="<u8").astype(np.uint64)
                values = values.reshape(self.sketch_count, -1) if self.sketch_count else values
            else:
                values = self._check(phase, update, sketches)
            self._append(UpdateCommitment(round_, update, sketches))
            phase.commitments[client_id] = Commitment(update, values)

    def _check(self, phase: CommitPhase, update: SignedUpdate, sketches: bytes) -> np.ndarray:
        roots = self.num_blocks + int(self.masked)
        if len(update.roots) != roots or any(len(r) != _ROOT_BYTES for r in update.roots):
            mask = " and the round's mask seed" if self.masked else ""
            raise InvalidArgumentError(
                f"a commitment has one {_ROOT_BYTES}-byte root per block ({self.num_blocks})"
                f"{mask}, got {len(update.roots)}"
            )
        if self.masked and update.roots[-1] != mask_seed(self._seed(phase)):
            raise InvalidArgumentError(
                f"the update of {update.client_id!r} was sparsified under another mask than "
                f"round {phase.round}'s"
            )
        low, high = self.weight_bounds
        if not (math.isfinite(update.weight) and low <= update.weight <= high):
            raise InvalidArgumentError(
                f"weight {update.weight:g} is outside the key holder's bounds [{low:g}, {high:g}]"
            )
        age = phase.version - update.version
        if not 0 <= age <= self.max_staleness:
            raise InvalidArgumentError(
                f"update trained version {update.version}; round {phase.round} takes versions "
                f"{max(0, phase.version - self.max_staleness)}..{phase.version}"
            )
        key = phase.members[update.client_id]
        if not update.verify(
            key, run_id=phase.run_id, round_=phase.round, context_id=phase.context_id
        ):
            raise InvalidArgumentError(
                f"the commitment of {update.client_id!r} is not signed for round "
                f"{phase.round} of this run under key generation {phase.context_id[:12]} "
                "(an update encrypted before the key holder rotated its keys is not)"
            )
        expected = 8 * self.sketch_count * self.num_blocks
        if len(sketches) != expected:
            raise InvalidArgumentError(f"sketches must be {expected} bytes, got {len(sketches)}")
        values = np.frombuffer(sketches, dtype="<u8").astype(np.uint64)
        if self.modulus and values.size and int(values.max()) >= self.modulus:
            raise InvalidArgumentError("a sketch is not below the modulus")
        return values.reshape(self.sketch_count, self.num_blocks)

    def close(self, round_: int, *, freeze: bool) -> tuple[list[str], bool]:
        """The committed clients so far and whether the phase is frozen.

        ``freeze``: accept no commitment after this.
        """
        with self._lock:
            phase = self._require(round_)
            if freeze and not phase.frozen:
                self._append(CommitClosing(round_, freeze=True))
                phase.frozen = True
            return sorted(phase.commitments), phase.frozen

    def updates(self, round_: int) -> list[SignedUpdate]:
        """Every committed signed update of ``round_``, by client id."""
        with self._lock:
            phase = self._require(round_)
            return [phase.commitments[c].update for c in sorted(phase.commitments)]

    def phase(self, round_: int) -> CommitPhase:
        """The frozen phase of ``round_``, for the key holder's checks."""
        with self._lock:
            phase = self._require(round_)
            if not phase.frozen:
                raise RoundClosedError(f"round {round_}'s commitments are still open")
            return phase

    def _member_phase(self, round_: int, client_id: str) -> CommitPhase:
        """``round_``'s phase, if ``client_id`` is in its cohort (the caller holds the lock)."""
        if len(client_id) > _MAX_ID:
            raise InvalidArgumentError(f"a client id has at most {_MAX_ID} characters")
        phase = self._require(round_)
        if client_id not in phase.members:
            raise UnknownClientError(f"{client_id!r} is not in the cohort of round {round_}")
        why = self._excluded.get(client_id)
        if why is not None:
            raise PolicyError(f"{client_id!r} is excluded: it was blamed on evidence ({why})")
        return phase

    def exclude(self, client_id: str, why: str) -> None:
        """Take no challenge request or commitment from ``client_id`` any more.

        It was blamed on evidence for ``why``.
        """
        with self._lock:
            self._excluded[client_id] = why

    @property
    def excluded(self) -> list[str]:
        """The clients excluded for good, sorted."""
        with self._lock:
            return sorted(self._excluded)

    def _require(self, round_: int) -> CommitPhase:
        phase = self._phases.get(round_)
        if phase is None:
            raise RoundClosedError(f"round {round_} is not open for commitments")
        return phase

    def close_log(self) -> None:
        """Close the log's files."""
        self._log.close()
