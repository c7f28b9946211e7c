"""The key holder: the only owner of the secret key, the global model and its optimizer.

It generates the CKKS key pair on first start (secret key in a 0600 file), serves the public
context, collects each round's commitments before the round opens for pushes
(:class:`server.keyholder.commit_board.CommitBoard`), and applies rounds: it fetches each shard's
encrypted sums and manifests, checks every block of them against the commitments of exactly
the clients the round closed with (:class:`~.aggregate_verifier.AggregateVerifier`: the
contributor sets, and a sketch of every coefficient), and only then decrypts, floods, divides
each block by its total weight, applies the server optimizer and publishes the next version of
every block to its shard. It never decrypts a single client's ciphertext. A round whose check
failed is never decrypted; the failure is traced to whoever caused it (:mod:`.blame`): a
shard proven to have changed a sum is counted, and after ``max_detections`` detections no
round is decrypted any more; a client proven to have sent key material, garbage or a lying
sketch is excluded from every later round, and a round whose canaries caught only such
clients is summed again without them. A shard that does not hand over its aggregates within
its deadline is counted apart (:class:`server.shard_misses.ShardMisses`, never a suspect):
after ``max_shard_misses`` misses in a row the round is refused, naming it, until the shard
answers again.

Every ``rotate_every_rounds`` rounds (10 by default) it replaces its CKKS key pair once a round
is applied: later rounds encrypt under the new public context (clients and shards fetch it,
signed, when a round names its id), and the old secret key is gone from memory and from disk.
One key then releases a bounded number of blocks, which bounds what changes that pass the
zero canaries can learn of it (:func:`crypto.release.releases_per_key`, docs/security.md),
and a key leaked by other means opens the ciphertexts of one period only.

At client level (DP-FedAvg) the key holder is the one party that sees a round's sum: when
fewer than the cohort's n clients contributed, it adds the missing shares of the noise to the
decrypted sum before anything is released, and it divides by the fixed n instead of the count
(McMahan et al. 2018's fixed-denominator estimator), so the released model is post-processing
of a sum that carries the noise the accountant assumes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crypto import PLAINTEXT_CONTEXT_ID, CkksParams, PlainContext, SecretContext, unpack_blocks
from crypto.canary import CanaryError
from crypto.files import read_checked, write_atomic, write_checked, write_private
from crypto.randomness import SecureRandom
from crypto.release import (
    decryption_error_bound,
    flood_and_round,
    released_std,
    releases_per_key,
)
from crypto.secret_context import SECRET_KEY_FILE
from crypto.signing import BlockSigner, model_block_digest
from crypto.sketch import Challenge, sketch_count
from fedps.accounting import ClientLevelNoise
from fedps.blocks import BlockLayout
from fedps.errors import (
    CorruptStateError,
    FedPSError,
    InvalidArgumentError,
    NotReadyError,
    PeerUnavailableError,
    PolicyError,
    QuarantinedError,
    ShardStalledError,
)
from fedps.hash_ring import HashRing
from fedps.keyholder_messages import ModelState
from fedps.messages import ParameterBlock
from fedps.shard_client import ShardClient
from fedps.shard_messages import Publication
from fedps.transport import batched
from server.keyholder.aggregate_verifier import AggregateVerifier, TamperingError
from server.keyholder.blame import Tracer, Verdict
from server.keyholder.commit_board import CommitBoard, CommitPhase
from server.keyholder.group_policy import GroupPolicy
from server.keyholder.server_optimizer import ServerOptimizer
from server.shard_misses import ShardMisses

__all__ = ["MAX_PARAMS", "KeyHolder", "RoundResult", "saved_version"]

_log = logging.getLogger("fedps")

_STATE_FILE = "keyholder-state.npz"
_STATE_WHAT = "the key holder state"
_STATE_HINT = (
    f"restore {_STATE_FILE} from a backup; without it the run cannot continue (docs/operations.md)"
)
MAX_PARAMS = 1 << 31  # about 8 GiB of float32
_CALL_S = 60.0  # deadline of each call to a shard: a restarting shard fails it, then a retry
# A state file written before the quorum's one name: its results' old field name
_OLD_FIELDS = {"min_contributors": "fewest_contributors"}


@dataclass(frozen=True)
class RoundResult:
    """What applying one round produced (cached: a repeated request gets the same result)."""

    round: int
    version: int
    fewest_contributors: int
    total_weight: float
    update_norm: float
    #: False: a flush that left the synchronous parameter groups as they were
    sync_groups_applied: bool = True
    #: every contributing client with its effective weight (weight x staleness multiplier)
    contributors: dict[str, float] = field(default_factory=dict)
    #: client level: the noise multiplier of the released sum (shares plus top-up); else 0
    noise_multiplier: float = 0.0
    #: client level: the std per value of the noise the key holder added to the sum
    top_up_std: float = 0.0


class _CanaryFailureError(CanaryError):
    """A canary check failed: the failing blocks with their aggregate rows, to trace."""

    def __init__(self, rows: list[int], message: str, aggregates: dict[int, np.ndarray]) -> None:
        super().__init__(rows, message)
        self.aggregates = aggregates
        self.blocks = sorted(aggregates)


@dataclass(frozen=True)
class _ModelSnapshot:
    params: np.ndarray
    version: int
    last_round: int
    optimizer: dict[str, np.ndarray]
    groups: dict[str, np.ndarray]


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
    min_quorum
        Fewest distinct clients an aggregate must contain to be decrypted.
    groups
        The mixed policy (async mode): values that change only when a round closes.
    weight_bounds
        The range every client's declared aggregation weight must lie in (``(1, 1)``:
        uniform weights).
    max_detections
        Detected tamperings by one shard after which no round is decrypted any more.
    max_shard_misses
        Fetches of one shard's aggregates in a row that miss ``shard_deadline_s`` after which
        a round is refused (:class:`~fedps.errors.ShardStalledError`) until the shard answers.
    shard_deadline_s
        The deadline of each fetch of a shard's aggregates.
    client_noise
        Client-level DP (:func:`fedps.accounting.client_level_noise`, the clients' own
        calibration): top each round's sum up to the full noise and divide by the fixed cohort
        size. None at example level.
    """

    def __init__(
        self,
        *,
        state_dir: Path,
        params: CkksParams,
        shards: dict[str, str],
        ring: HashRing,
        optimizer: ServerOptimizer,
        min_quorum: int,
        encrypted: bool = True,
        max_clients: int = 1 << 30,
        max_abs_value: float = 1.0,
        flood_bits: int = 4,
        rotate_every_rounds: int = 10,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
        groups: GroupPolicy | None = None,
        weight_bounds: tuple[float, float] = (1.0, 1.0),
        max_detections: int = 3,
        max_shard_misses: int = 3,
        shard_deadline_s: float = _CALL_S,
        client_noise: ClientLevelNoise | None = None,
    ) -> None:
        if min_quorum < 1:
            raise InvalidArgumentError("min_quorum must be at least 1")
        if client_noise is not None and (groups is not None or staleness is not None):
            raise InvalidArgumentError("client-level noise needs synchronous rounds")
        self._dir = state_dir
        _require_keys(state_dir)
        self.keys = SecretContext.load_or_generate(state_dir / "keys", params)
        self._ring = ring
        self._shards = {sid: ShardClient(sid, addr) for sid, addr in shards.items()}
        self._optimizer = optimizer
        self.min_quorum = min_quorum
        self.encrypted = encrypted
        self.max_clients = max_clients
        self.max_abs_value = max_abs_value
        self.flood_bits = flood_bits
        self.max_detections = max_detections
        self.rotate_every_rounds = rotate_every_rounds
        self._staleness = staleness
        self._max_staleness = max_staleness
        self._groups = groups
        self._client_noise = client_noise
        self._noise = SecureRandom()  # the top-up: nobody else may be able to regenerate it
        challenge_key = _load_or_create_secret(state_dir / "keys" / "challenge.key")
        self.signer = BlockSigner.load_or_create(state_dir / "keys" / "signing.key")
        write_atomic(
            state_dir / "keys" / "signing.pub", self.signer.public_key.hex().encode() + b"\n"
        )
        if not encrypted:
            _log.warning("encryption is OFF: updates travel and are summed in plaintext")
        self._lock = threading.Lock()
        self.params: np.ndarray | None = None
        self.version = 0
        self.last_round = 0
        self._released: dict[int, RoundResult] = {}
        self._refused: set[int] = set()  # rounds whose check failed: never decrypted
        #: detected tamperings by shard, then by reason
        self.detections: dict[str, dict[str, int]] = {}
        #: called with (shard, reason) for each detection (metrics)
        self.on_tampering: Callable[[str, str], None] | None = None
        #: clients proven guilty (:mod:`.blame`), with what they did; excluded for good
        self.blamed: dict[str, str] = {}
        #: called with the client for each blame (metrics)
        self.on_blame: Callable[[str], None] | None = None
        #: the fetches of each shard that missed their deadline (not persisted)
        self.shard_misses = ShardMisses(limit=max_shard_misses, deadline_s=shard_deadline_s)
        self.last_saved = 0.0  # unix time of the last state checkpoint
        self._key_since = 0  # the last round applied before the current key pair was made
        self._load_state()
        self._check_rotation()
        modulus = self.keys.public.modulus
        self.commits = CommitBoard(
            state_dir / "commits",
            secret=challenge_key,
            num_blocks=self.layout.num_blocks if self.params is not None else 0,
            modulus=modulus if encrypted else 0,
            sketch_count=sketch_count(modulus) if encrypted else 0,
            max_staleness=max_staleness if staleness is not None else 0,
            weight_bounds=weight_bounds,
        )
        for client, why in self.blamed.items():
            self.commits.exclude(client, why)

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
            self.commits.num_blocks = self.layout.num_blocks
            self._optimizer.state.clear()
            try:
                self._publish()
                self._save_state()
            except Exception as exc:
                # Nothing changes unless every shard took the new model and it is saved.
                self.params, self.version, self._optimizer.state = before
                if isinstance(exc, OSError):
                    raise PeerUnavailableError(
                        f"the key holder cannot write its state ({exc.strerror or exc})"
                    ) from exc
                raise
            self._check_rotation()

    # ------------------------------------------------------------------ commitments
    def open_commits(
        self, round_: int, version: int, run_id: str, context_id: str, members: dict[str, bytes]
    ) -> None:
        """Start ``round_``'s commit phase for ``members`` (the coordinator's call)."""
        if self.params is None:
            raise NotReadyError("the key holder has no model yet")
        if context_id != self.context_id:
            raise InvalidArgumentError("the round names another key generation (context id)")
        if round_ <= self.last_round:
            raise PolicyError(f"round {round_} is not after the last applied round")
        self.commits.open(round_, version, run_id, context_id, members)

    def challenge(self, round_: int) -> Challenge | None:
        """The secret challenge of ``round_`` (None without encryption)."""
        if not self.encrypted:
            return None
        public = self.keys.public
        return Challenge(
            self.commits.seed(round_),
            modulus=public.modulus,
            coeffs_per_block=public.coeffs_per_block,
        )

    def detection_counts(self) -> dict[str, int]:
        """Detections so far, by shard."""
        with self._lock:
            return {shard: sum(r.values()) for shard, r in self.detections.items()}

    def detection_reasons(self) -> dict[str, int]:
        """Detections so far, by reason, summed over the shards."""
        with self._lock:
            return dict(sum((Counter(r) for r in self.detections.values()), Counter()))

    def model_state(self) -> ModelState:
        """The model's version, size and last round, the tampering detected so far and the
        shards' missed deadlines."""
        return ModelState(
            version=self.version,
            num_params=0 if self.params is None else self.params.size,
            initialized=self.params is not None,
            last_round=self.last_round,
            detections=self.detection_counts(),
            quarantined=tuple(self.quarantined),
            detection_reasons=self.detection_reasons(),
            shard_misses=self.shard_misses.totals(),
            stalled=tuple(self.shard_misses.stalled),
            blamed=dict(self.blamed),
        )

    def clear_detections(self) -> None:
        """Forget every detection (the operator replaced the suspect shards); refused
        rounds stay refused."""
        with self._lock:
            if self.detections:
                _log.warning("clearing tampering detections: %s", self.detections)
            self.detections = {}
            if self.params is not None:
                self._save_state()

    @property
    def quarantined(self) -> list[str]:
        """Shards caught tampering ``max_detections`` times or more."""
        return sorted(
            shard
            for shard, reasons in self.detections.items()
            if sum(reasons.values()) >= self.max_detections
        )

    # ------------------------------------------------------------------ rounds
    def apply_round(
        self, round_: int, version: int, run_id: str = "", members: dict[str, bytes] | None = None
    ) -> RoundResult:
        """Verify, decrypt and apply round ``round_``'s aggregates; publish the next version.

        Raises
        ------
        PolicyError
            If the decryption policy refuses: an aggregate of fewer than ``min_quorum``
            distinct signed contributors, a contribution that is not signed by a cohort member,
            a tampered aggregate, a missing block, an out-of-bounds result, or a round that does
            not follow the current version. A round already applied returns its released
            result again, never a fresh decryption.
        ShardStalledError
            A shard missed the deadline of its fetch ``max_shard_misses`` times in a row:
            nothing is decrypted, and the round is applied once the shard answers.
        PeerUnavailableError
            If the state cannot be written (nothing is applied; asking again applies the round),
            a shard does not take the new version (the round is applied and durable; asking
            again publishes it), or a shard's aggregates did not arrive (a miss below the
            limit). Never a refusal: the caller retries.
        """
        with self._lock:
            cached = self._released.get(round_)
            if cached is not None:
                if round_ == self.last_round:  # the first attempt may not have published
                    self._publish_applied(round_)
                return cached
            if round_ in self._refused:
                raise PolicyError(f"round {round_} was refused before; it is never decrypted")
            quarantined = self.quarantined
            if quarantined:
                raise QuarantinedError(
                    f"{', '.join(quarantined)} handed over tampered aggregates "
                    f"{self.max_detections} times or more; the key holder decrypts nothing "
                    "until the shard is replaced and the key holder restarted with its "
                    "detections cleared (docs/operations.md)"
                )
            if self.params is None:
                raise NotReadyError("the key holder has no model yet")
            if version != self.version:
                raise PolicyError(
                    f"round {round_} trained version {version}, the model is at {self.version}"
                )
            if round_ <= self.last_round:
                raise PolicyError(f"round {round_} is not after the last applied round")
            phase = self.commits.phase(round_)
            if (phase.run_id, phase.version, phase.context_id) != (
                run_id,
                version,
                self.context_id,
            ):
                raise PolicyError(
                    f"round {round_} was committed to for another run, version or key generation"
                )
            layout = self.layout
            contributors = set(members or {})
            while True:  # a request the policy refuses raises here, refusing nothing
                verifier = AggregateVerifier(
                    phase=phase,
                    contributors=contributors,
                    min_quorum=self.min_quorum,
                    max_clients=self.max_clients,
                    challenge=self.challenge(round_),
                    staleness=self._staleness,
                    max_staleness=self._max_staleness,
                )
                try:
                    delta, manifests, top_up = self._decrypt_average(round_, layout, verifier)
                    break
                except ShardStalledError:
                    raise  # no check failed: the round is applied once the shard answers
                except PolicyError as exc:
                    refusal, guilty = self._trace(round_, phase, verifier, exc)
                    if refusal is None:  # only contributors, and nothing revealed: again
                        contributors -= guilty
                        continue
                    self._refuse(round_, refusal)
                    raise refusal from exc
            before = self._snapshot()
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
                fewest_contributors=min(len(m) for m in manifests.values()),
                total_weight=sum(manifests[0].values()),
                update_norm=float(np.linalg.norm(delta)),
                sync_groups_applied=round_closed,
                contributors={c: w for m in manifests.values() for c, w in m.items()},
                noise_multiplier=self._present_multiplier(manifests, top_up),
                top_up_std=top_up,
            )
            self._released[round_] = result
            try:
                self._save_state()  # the decision is durable before anything is published
            except OSError as exc:
                self._restore(before)
                del self._released[round_]
                message = (
                    f"the key holder cannot write its state ({exc.strerror or exc}); round "
                    f"{round_} is not applied, asking again applies it"
                )
                _log.error("%s", message)
                raise PeerUnavailableError(message) from exc
            if self._rotation_due():
                self._rotate_keys()
            self._publish_applied(round_)
            _log.info(
                "applied round %d (%d+ contributors), published version %d",
                round_,
                result.fewest_contributors,
                self.version,
            )
            return result

    def _snapshot(self) -> _ModelSnapshot:
        """What applying a round changes, to put back when its state cannot be saved."""
        assert self.params is not None
        groups = self._groups.state() if self._groups is not None else {}
        return _ModelSnapshot(
            self.params,
            self.version,
            self.last_round,
            dict(self._optimizer.state),
            {k: v.copy() for k, v in groups.items()},
        )

    def _restore(self, snapshot: _ModelSnapshot) -> None:
        self.params, self.version, self.last_round = (
            snapshot.params,
            snapshot.version,
            snapshot.last_round,
        )
        self._optimizer.state = dict(snapshot.optimizer)
        if self._groups is not None:
            self._groups.load(snapshot.groups)

    def _publish_applied(self, round_: int) -> None:
        """Publish the version round ``round_`` produced; a shard that does not take it
        leaves the round applied (durably) and unpublished, and the caller is asked to retry:
        the next :meth:`apply_round` of the same round publishes it again (idempotently)."""
        try:
            self._publish()
        except FedPSError as exc:
            message = (
                f"round {round_} is applied (version {self.version}) but not yet published to "
                f"every shard ({exc}); asking again publishes it"
            )
            _log.warning("%s", message)
            raise PeerUnavailableError(message) from exc

    def _rotation_due(self) -> bool:
        """Whether ``rotate_every_rounds`` rounds have passed since the key pair was made
        (round numbers: a round abandoned in between counts too, which errs on the safe
        side)."""
        period = self.rotate_every_rounds
        return self.encrypted and period > 0 and self.last_round - self._key_since >= period

    def _rotate_keys(self) -> None:
        """Replace the key pair once a round is applied and saved: later rounds encrypt under
        a new context; the old secret key is gone from memory and from ``keys/`` (replaced
        in one step, :meth:`crypto.SecretContext.save`). A pair that cannot be written
        leaves the current one in use, and the next applied round tries again."""
        keys = SecretContext.generate(self.keys.public.params)  # same parameters and layout
        try:
            keys.save(self._dir / "keys")
        except OSError as exc:
            _log.error(
                "cannot write a new key pair (%s); the current keys stay in use, the next "
                "applied round tries again",
                exc.strerror or exc,
            )
            return
        self.keys, self._key_since = keys, self.last_round
        _log.info(
            "rotated the CKKS keys after round %d; new context %s",
            self.last_round,
            keys.public.context_id[:12],
        )

    def _check_rotation(self) -> None:
        """Warn when one key pair may release more blocks of the model than the leakage
        bound allows (:func:`crypto.release.releases_per_key`, docs/security.md)."""
        if not self.encrypted or self.params is None:
            return
        period, blocks = self.rotate_every_rounds, self.layout.num_blocks
        budget = releases_per_key(self.keys.public.params, self.flood_bits)
        if period and period * blocks <= budget:
            return
        advice = (
            f"set it to {budget // blocks} or fewer"
            if budget >= blocks
            else "even a new key every round exceeds it: raise security.flood_bits"
        )
        _log.warning(
            "security.rotate_every_rounds = %d (0: never) lets one key pair release %s blocks "
            "of this %d-block model; the leakage bound allows %d per key (docs/security.md): %s",
            period,
            f"{period * blocks}" if period else "every round's",
            blocks,
            budget,
            advice,
        )

    def _trace(
        self, round_: int, phase: CommitPhase, verifier: AggregateVerifier, exc: PolicyError
    ) -> tuple[PolicyError | None, set[str]]:
        """After check ``exc`` failed: trace it to whoever caused it (:mod:`.blame`), blame
        the guilty clients, and say whether to refuse the round (with which error: a
        :class:`TamperingError` counts against its shard) or to try again without the guilty
        clients (None: only clients were guilty, of a canary that nothing revealed, and the
        rest still make a quorum)."""
        tracer = Tracer(round_, phase, verifier.multipliers, self.keys, self._unpack)
        verdict = Verdict()
        if isinstance(exc, _CanaryFailureError):
            for sid in sorted({self._ring.owner(b) for b in exc.blocks}):
                found = tracer.canaries(
                    self._shards[sid],
                    [b for b in exc.blocks if self._ring.owner(b) == sid],
                    exc.aggregates,
                )
                verdict.clients.update(found.clients)
                verdict.shard = verdict.shard or found.shard
        elif isinstance(exc, TamperingError) and exc.reason == "aggregate" and exc.blocks:
            challenge = self.challenge(round_)
            assert challenge is not None  # a sketch failed
            verdict = tracer.sketches(self._shards[exc.shard], exc.blocks, challenge)
            if not verdict:
                exc = PolicyError(
                    f"round {round_}: {exc.shard}'s aggregate failed its check and the shard "
                    "showed no evidence (it did not answer); nobody is blamed, the round is "
                    "refused"
                )
        for client, why in sorted(verdict.clients.items()):
            self._blame(round_, client, why)
        guilty = set(verdict.clients)
        if verdict.shard is not None:
            return verdict.shard, guilty
        if guilty and isinstance(exc, _CanaryFailureError):
            left = len(verifier.contributors - guilty)
            if left >= self.min_quorum:
                _log.warning(
                    "round %d: summing the %d other contributors instead (nothing of the "
                    "round was decrypted)",
                    round_,
                    left,
                )
                return None, guilty
        if guilty:
            first = min(guilty)
            message = f"round {round_}: {first} blamed ({verdict.clients[first]})"
            return PolicyError(f"{message}; the round is refused"), guilty
        return exc, guilty

    def _blame(self, round_: int, client: str, why: str) -> None:
        """Exclude ``client`` from every later round: the evidence proved ``why``."""
        self.blamed[client] = f"round {round_}: {why}"
        self.commits.exclude(client, self.blamed[client])
        _log.warning(
            "round %d: %s blamed on evidence (%s); it is excluded from later rounds",
            round_,
            client,
            why,
        )
        if self.on_blame is not None:
            self.on_blame(client)

    def _refuse(self, round_: int, exc: PolicyError) -> None:
        """Never decrypt ``round_``; count a detected tampering against its shard."""
        self._refused.add(round_)
        if isinstance(exc, TamperingError):
            reasons = self.detections.setdefault(exc.shard, {})
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            _log.warning(
                "round %d: %s sent a tampered %s (detection %d); the round is never decrypted",
                round_,
                exc.shard,
                exc.reason,
                sum(reasons.values()),
            )
            if self.on_tampering is not None:
                self.on_tampering(exc.shard, exc.reason)
        try:
            self._save_state()
        except OSError as exc:  # the check fails the same way if the round is asked again
            _log.error("round %d: cannot record the refusal (%s)", round_, exc.strerror or exc)

    def _decrypt_average(
        self, round_: int, layout: BlockLayout, verifier: AggregateVerifier
    ) -> tuple[np.ndarray, dict[int, dict[str, float]], float]:
        """The round's weighted average update, each block's contributors with their
        effective weights (weight x staleness multiplier; a block's total is their sum), and
        the std of the client-level top-up noise added to each value of the sum (0 without).

        Nothing is decrypted before every block of every shard passed every check. At client
        level the average divides the topped-up sum by the fixed cohort size."""
        blocks, rows = verifier.verify(
            {
                sid: self.shard_misses.stream(
                    sid,
                    "FetchAggregate",
                    shard.fetch_aggregate(
                        round_, verifier.contributors, timeout_s=self.shard_misses.deadline_s
                    ),
                )
                for sid, shard in self._shards.items()
            },
            owner=self._ring.owner,
            num_blocks=layout.num_blocks,
            block_bytes=self._block_bytes(),
            unpack=self._unpack,
        )
        multipliers = verifier.multipliers
        effective = {c: verifier.weights[c] * multipliers[c] for c in verifier.contributors}
        total = sum(effective.values())
        top_up = 0.0
        noise = self._client_noise
        if noise is not None:  # the sum of m shares: every weight and multiplier is 1
            if any(w != 1.0 for w in effective.values()):
                raise PolicyError("client-level DP sums unweighted updates; a weight is not 1")
            top_up = noise.top_up_std(len(effective))
            total = float(noise.cohort)
        opened = self._open(round_, blocks, rows, list(multipliers.values()))
        averaged: dict[int, np.ndarray] = {}
        for block, values in zip(blocks, opened, strict=True):
            summed = self._release(values, list(multipliers.values()), block)
            if top_up > 0:  # after the bound check, which covers the clients' values only
                summed = summed + self._noise.normal(top_up, summed.shape)
            averaged[block] = summed / total
        manifests = {b: dict(effective) for b in averaged}
        return layout.join(averaged), manifests, top_up

    def _open(
        self, round_: int, blocks: list[int], rows: np.ndarray, multipliers: list[int]
    ) -> np.ndarray:
        """Every block's decrypted sum, once every zero canary of every block is within the
        noise bound (:mod:`crypto.canary`): a change to ``c1`` anywhere, by a client on its
        own ciphertext or by a shard, and nothing of the round is decrypted."""
        if not self.encrypted:
            return rows
        try:
            return self.keys.open(rows, noise_weight=sum(m * m for m in multipliers))
        except CanaryError as exc:
            failed = [blocks[r] for r in exc.rows]
            _log.warning(
                "round %d: blocks %s carry a change in c1 (a zero canary exceeds the noise "
                "bound); nothing of this sum is decrypted",
                round_,
                failed[:8],
            )
            raise _CanaryFailureError(
                exc.rows,
                f"round {round_}: {len(failed)} block(s) carry key material ({exc})",
                {blocks[r]: rows[r] for r in exc.rows},
            ) from exc
        except InvalidArgumentError as exc:
            raise PolicyError(f"round {round_} cannot be decrypted: {exc}") from exc

    def _present_multiplier(self, manifests: dict[int, dict[str, float]], top_up: float) -> float:
        """The noise multiplier a client-level round's released sum carries (0: example
        level, where the noise is each client's own DP-SGD)."""
        if self._client_noise is None:
            return 0.0
        return self._client_noise.present_multiplier(len(manifests[0]), top_up)

    def _release(self, summed: np.ndarray, multipliers: list[int], block: int) -> np.ndarray:
        """Flood and round a decrypted sum of ciphertexts weighted by integer ``multipliers``
        (all 1 in sync rounds), then refuse it if it breaks the clipping bound."""
        margin = 0.0
        contributors = sum(multipliers)  # every value is at most this x max_abs_value
        if self.encrypted and self.flood_bits > 0:
            # the error of sum m_i c_i grows with sqrt(sum m_i^2), not sqrt(sum m_i)
            sigma = 2.0**self.flood_bits * decryption_error_bound(
                self.keys.public.params, sum(m * m for m in multipliers)
            )
            summed = flood_and_round(summed, sigma)
            margin = 8 * released_std(sigma)
        bound = contributors * self.max_abs_value * (1 + 1e-6) + margin
        if float(np.abs(summed).max()) > bound:
            # (the decrypted value stays here: the message reaches the coordinator's logs)
            raise PolicyError(
                f"block {block}: a decrypted sum exceeds the bound that {contributors} clients "
                f"clipped to {self.max_abs_value:g} allow; refusing to apply"
            )
        return summed

    @property
    def context_id(self) -> str:
        """The id clients must encrypt under (or the plaintext id, encryption off)."""
        return self.keys.public.context_id if self.encrypted else PLAINTEXT_CONTEXT_ID

    def _block_bytes(self) -> int:
        """Bytes of one packed aggregate block."""
        if not self.encrypted:
            return PlainContext(self.keys.public.params.values_per_block).block_bytes
        return self.keys.public.block_bytes

    def _unpack(self, data: list[bytes]) -> np.ndarray:
        """Validated coefficients of aggregate blocks (values, encryption off)."""
        if not self.encrypted:
            return PlainContext(self.keys.public.params.values_per_block).unpack_blocks(data)
        return unpack_blocks(self.keys.public, data)

    def _publish(self) -> None:
        assert self.params is not None
        layout = self.layout
        n = layout.values_per_block
        per_shard: dict[str, list[ParameterBlock]] = {s: [] for s in self._shards}
        for b in range(layout.num_blocks):
            values = layout.block_of(self.params, b).astype("<f4").tobytes()
            signature = self.signer.sign(model_block_digest(self.version, b, values))
            per_shard[self._ring.owner(b)].append(
                ParameterBlock(b, self.version, values, signature)
            )
        for sid, blocks in per_shard.items():
            messages = [
                Publication(self.version, layout.num_blocks, n, tuple(batch))
                for batch in batched(blocks, lambda p: len(p.values))
            ] or [Publication(self.version, layout.num_blocks, n)]
            self._shards[sid].publish(messages, timeout_s=_CALL_S)

    # ------------------------------------------------------------------ durability
    def _save_state(self) -> None:
        assert self.params is not None
        path = self._dir / _STATE_FILE
        meta = {
            "version": self.version,
            "last_round": self.last_round,
            "released": {str(k): asdict(v) for k, v in self._released.items()},
            "refused": sorted(self._refused),
            "detections": self.detections,
            "blamed": self.blamed,
            "key_context": self.context_id,
            "key_since": self._key_since,
        }
        arrays: dict[str, np.ndarray] = {
            "params": self.params,
            "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        }
        arrays.update({f"opt_{k}": v for k, v in self._optimizer.state.items()})
        if self._groups is not None:
            arrays.update({f"groups_{k}": v for k, v in self._groups.state().items()})
        buffer = io.BytesIO()
        np.savez(buffer, *[], **arrays)  # type: ignore[arg-type]
        write_checked(path, buffer.getbuffer())
        self.last_saved = time.time()

    def _load_state(self) -> None:
        """Resume from the state file, if there is one.

        Raises
        ------
        CorruptStateError
            The file is damaged (checksum, truncation) or does not hold a key holder's state.
        """
        path = self._dir / _STATE_FILE
        raw = _read_state(path)
        if raw is None:
            return
        try:
            with np.load(io.BytesIO(raw)) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                self.params = data["params"]
                opt = {k[4:]: data[k] for k in data.files if k.startswith("opt_")}
                self._optimizer.state = opt
                if self._groups is not None:
                    groups = {k[7:]: data[k] for k in data.files if k.startswith("groups_")}
                    self._groups.load(groups)
            self.version = int(meta["version"])
            self.last_round = int(meta["last_round"])
            self._released = {
                int(k): RoundResult(**{_OLD_FIELDS.get(f, f): x for f, x in v.items()})
                for k, v in meta["released"].items()
            }
            self._refused = {int(r) for r in meta.get("refused", [])}
            self.detections = {
                str(shard): {str(k): int(v) for k, v in reasons.items()}
                for shard, reasons in meta.get("detections", {}).items()
            }
            self.blamed = {str(c): str(why) for c, why in meta.get("blamed", {}).items()}
            self._key_since = self._saved_key_since(meta)
        except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            raise CorruptStateError(
                f"{path}: {_STATE_WHAT} cannot be read ({exc}); {_STATE_HINT}"
            ) from exc
        self.last_saved = path.stat().st_mtime
        _log.info("key holder resumed at version %d (round %d)", self.version, self.last_round)

    def _saved_key_since(self, meta: Mapping[str, Any]) -> int:
        """The last round applied before the loaded key pair was made. The state is saved
        before the keys rotate: keys of another context than the state names were made
        after its last round; a state that names none predates rotation (count from 0)."""
        context = meta.get("key_context")
        if context is None:
            return 0
        if context != self.context_id:
            return self.last_round
        return int(meta["key_since"])


#: What the loss of each key of a key holder that already has state means.
_LOST_KEYS = {
    SECRET_KEY_FILE: (
        "the secret key of this run is lost, and every ciphertext not yet decrypted with it; "
        "start a new run"
    ),
    "signing.key": (
        "the key that signs every published model is lost, and a new one would not match the "
        "signing.pub that shards and clients verify against; restore it from a backup, or "
        "start a new run"
    ),
    "challenge.key": (
        "the key behind the commitment challenges is lost, and a new one would fail every "
        "commitment of the rounds now open; restore it from a backup, or start a new run"
    ),
}


def _require_keys(state_dir: Path) -> None:
    """Stop when a key of a key holder that already has state is missing: a key made anew in
    its place would silently break what the old one protects. On a first start (no state)
    the keys are created.

    Raises
    ------
    CorruptStateError
        One line naming the missing key and what to do.
    """
    state = state_dir / _STATE_FILE
    if not state.exists():
        return
    for name, lost in _LOST_KEYS.items():
        key = state_dir / "keys" / name
        if not key.exists():
            raise CorruptStateError(
                f"{key} is missing but {state} exists: {lost} (docs/operations.md)"
            )


def _read_state(path: Path) -> bytes | None:
    """The key holder's state file, checked (None when there is none).

    Raises
    ------
    CorruptStateError
        The file is damaged.
    """
    return read_checked(path, what=_STATE_WHAT, hint=_STATE_HINT, legacy_prefix=b"PK\x03\x04")


def saved_version(state_dir: Path) -> int | None:
    """The model version the key holder whose state folder is ``state_dir`` last applied, from
    its state file (None when it saved none).

    Raises
    ------
    CorruptStateError
        The file is damaged or holds no version.
    """
    path = state_dir / _STATE_FILE
    raw = _read_state(path)
    if raw is None:
        return None
    try:
        with np.load(io.BytesIO(raw)) as data:
            return int(json.loads(bytes(data["meta"]).decode())["version"])
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise CorruptStateError(
            f"{path}: {_STATE_WHAT} cannot be read ({exc}); {_STATE_HINT}"
        ) from exc


def _load_or_create_secret(path: Path) -> bytes:
    """A 32-byte secret kept in a 0600 file (created on first use, see :func:`_require_keys`).

    Raises
    ------
    CorruptStateError
        The file does not hold 32 bytes.
    """
    if path.exists():
        secret = path.read_bytes()
        if len(secret) != 32:
            raise CorruptStateError(
                f"{path}: the key is corrupt ({len(secret)} bytes, not 32); restore it from a "
                "backup (docs/operations.md)"
            )
        return secret
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = os.urandom(32)
    write_private(path, secret, exclusive=True)
    return secret
