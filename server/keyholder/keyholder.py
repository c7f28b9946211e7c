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

How one aggregate is applied, in reading order: :meth:`KeyHolder.apply_round` (the policy,
then the steps below); :meth:`.Decryptor.average <.decryptor.Decryptor.average>`, which
streams each shard's sums in (:class:`~.shard_peers.ShardPeers`), has
:class:`~.aggregate_verifier.AggregateVerifier` check every block against the commitments, and
only then checks the canaries, decrypts, floods, bounds and averages (it also rotates the key
pair every ``rotate_every_rounds`` rounds); with ``compression.density`` below 1 the aggregate
is the packed coordinates of the round's mask (:meth:`KeyHolder.mask`), scattered back into the
whole vector afterwards (docs/compression.md); :mod:`.blame` after a failed check
(:func:`~.blame.judge`), with what it proved kept by :class:`~.suspects.Suspects`; the server
optimizer's step (:class:`~.global_model.GlobalModel`); the state, durable before anything is
published (:class:`~.state_store.StateStore`); the signed publication
(:class:`~.model_publisher.ModelPublisher`, through :meth:`.ShardPeers.publish
<.shard_peers.ShardPeers.publish>`).

:meth:`KeyHolder.open` builds a key holder from its settings
(:class:`~.keyholder_settings.KeyHolderSettings`, which :func:`server.serve.keyholder_settings`
makes from the configuration): it reads or creates the keys and loads the state
(:class:`~.state_store.StateStore`), opens the commit log and the shard clients, and hands
them to the constructor, which does no I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from crypto import PublicContext, SecretContext
from crypto.files import private_directory
from crypto.signing import BlockSigner
from crypto.sketch import Challenge, sketch_count
from fedps.errors import (
    InvalidArgumentError,
    NotReadyError,
    PeerUnavailableError,
    PolicyError,
    ShardStalledError,
)
from fedps.round_timer import RoundTimer
from fedps.rpc.keyholder_messages import ModelState
from fedps.rpc.shard_stub import ShardStub
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from fedps.sharding.sparse_mask import SparseMask, sent_blocks, upload_layout
from server.keyholder.aggregate_verifier import AggregateVerifier, TamperingError
from server.keyholder.blame import judge, untraced_refusal
from server.keyholder.commit_board import CommitBoard
from server.keyholder.decryptor import Decryptor, OffGridRefusalError
from server.keyholder.global_model import GlobalModel
from server.keyholder.group_policy import GroupPolicy
from server.keyholder.joint_keys import JointKeys
from server.keyholder.keyholder_settings import KeyHolderSettings
from server.keyholder.model_publisher import ModelPublisher
from server.keyholder.server_optimizer import ServerOptimizer
from server.keyholder.shard_peers import ShardPeers
from server.keyholder.state_store import KeyHolderState, RoundResult, StateStore
from server.keyholder.suspects import Suspects
from server.shard_misses import ShardMisses

__all__ = ["MAX_PARAMS", "KeyHolder", "RoundResult"]

_log = logging.getLogger("fedps")

MAX_PARAMS = 1 << 31  # about 8 GiB of float32


class KeyHolder:
    """Decrypts aggregates only and applies them to the global model.

    Build one with :meth:`open`, which does the I/O; the constructor takes what it made.

    Parameters
    ----------
    settings
        The decryption policy and its limits.
    keys
        The current CKKS key pair, or (key-holder parties) the joint public context and the
        parties that decrypt under it.
    signer
        Signs every published model block.
    commits
        The commit phases of the rounds (with their log), already replayed.
    store
        The state folder, written after every change of the state.
    shards
        Every shard, as the key holder calls it.
    optimizer
        The server optimizer.
    groups
        The mixed policy (async mode): values that change only when a round closes.
    state
        The saved state to resume from (None: a first start).

    Raises
    ------
    InvalidArgumentError
        Client-level noise with a mixed policy (asynchronous updates), or keys of other
        parameters than the quantized packing's.
    """

    def __init__(
        self,
        settings: KeyHolderSettings,
        *,
        keys: SecretContext | JointKeys,
        signer: BlockSigner,
        commits: CommitBoard,
        store: StateStore,
        shards: ShardPeers,
        optimizer: ServerOptimizer,
        groups: GroupPolicy | None = None,
        state: KeyHolderState | None = None,
    ) -> None:
        _require_sync(settings, groups)
        self.settings = settings
        self.signer = signer
        self.commits = commits
        self._store = store
        self._shards = shards
        #: the parameters, version and last applied round, with the optimizer that steps them
        self.model = GlobalModel(optimizer, groups)
        self._publisher = ModelPublisher(self.model, shards, signer)  # every version, signed
        self._decryptor = Decryptor(keys, settings)
        if not settings.encrypted:
            _log.warning("encryption is OFF: updates travel and are summed in plaintext")
        self._lock = threading.Lock()
        self._released: dict[int, RoundResult] = {}
        self._refused: set[int] = set()  # rounds whose check failed: never decrypted
        #: detected tamperings by shard and blamed clients (:mod:`.suspects`)
        self.suspects = Suspects(max_detections=settings.max_detections, exclude=commits.exclude)
        self.shard_misses = shards.misses  #: each shard's missed fetch deadlines (not persisted)
        self.last_saved = 0.0  # unix time of the last state checkpoint
        if state is not None:
            self.model.restore(state.model)
            self._released, self._refused = dict(state.released), set(state.refused)
            self.suspects.load(state.detections, state.blamed)
            self._decryptor.key_since = state.key_since_for(self.context_id)
            self.last_saved = state.saved_at
        if self.params is not None:
            self._decryptor.check_rotation(self.upload_layout.num_blocks)

    @classmethod
    def open(
        cls,
        state_dir: Path,
        settings: KeyHolderSettings,
        *,
        shards: Mapping[str, str],
        ring: HashRing,
        optimizer: ServerOptimizer,
        groups: GroupPolicy | None = None,
        parties: Mapping[int, str] | None = None,
    ) -> KeyHolder:
        """The key holder whose state folder is ``state_dir`` (made private, 0700).

        Its keys read, or created on a first start, its state and commit log loaded, a client opened
        for each shard.

        Parameters
        ----------
        state_dir
            Where the keys, the state file and the commit log live.
        settings
            The decryption policy and its limits.
        shards
            ``{shard_id: address}`` of every shard.
        ring
            The cluster's hash ring.
        optimizer, groups
            As the constructor takes them.
        parties
            ``{index: address}`` of every key-holder party when ``settings.parties`` is above
            1: the key holder is then their combiner and holds no secret key
            (:class:`~.joint_keys.JointKeys`).

        Raises
        ------
        CorruptStateError
            The state file or the commit log is damaged, or a key of a key holder that has
            state is missing (one line naming it and what to do).
        InvalidArgumentError
            Client-level noise with a mixed policy (asynchronous updates).
        """
        _require_sync(settings, groups)
        store = StateStore(private_directory(state_dir))
        keys, signer, challenge_secret = store.open_key_material(settings, parties)
        state = store.load()
        saved = state.model.params if state is not None else None
        board = _commit_board(state_dir / "commits", settings, keys.public, challenge_secret, saved)
        return cls(
            settings,
            keys=keys,
            signer=signer,
            commits=board,
            store=store,
            shards=ShardPeers(
                {sid: ShardStub(sid, address) for sid, address in shards.items()},
                ring,
                ShardMisses(limit=settings.max_shard_misses, deadline_s=settings.shard_deadline_s),
            ),
            optimizer=optimizer,
            groups=groups,
            state=state,
        )

    @property
    def params(self) -> np.ndarray | None:
        """The global model (None until the chief sets it)."""
        return self.model.params

    @property
    def version(self) -> int:
        """The model's version."""
        return self.model.version

    @property
    def last_round(self) -> int:
        """The last round applied."""
        return self.model.last_round

    @property
    def keys(self) -> SecretContext | JointKeys:
        """The CKKS key pair (rotated every ``rotate_every_rounds`` rounds), or the parties'."""
        return self._decryptor.keys

    @property
    def context_id(self) -> str:
        """The id clients must encrypt under (or the plaintext id, encryption off)."""
        return self._decryptor.context_id

    @property
    def layout(self) -> BlockLayout:
        """The model's block layout."""
        if self.params is None:
            raise NotReadyError("the key holder has no model yet")
        return BlockLayout(self.params.size, self.keys.public.params.values_per_block)

    @property
    def upload_layout(self) -> BlockLayout:
        """An update's layout: the model's, ``K`` values per coefficient with quantized packing."""
        return upload_layout(self.layout, self.settings.fields)

    def mask(self, round_: int) -> SparseMask | None:
        """The mask ``round_``'s updates are sparsified under (None: whole updates).

        Its seed comes from the round's challenge seed (:meth:`.CommitBoard.mask_seed`).
        """
        if self.settings.density >= 1:
            return None
        return SparseMask(self.upload_layout, self.settings.density, self.commits.mask_seed(round_))

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
                self._publisher.publish(self.layout)
                return
            before = self.model.start(vector, version)
            self.commits.num_blocks = sent_blocks(
                self.layout.num_blocks, self.settings.density, self.settings.fields
            )
            try:
                self._publisher.publish(self.layout)
                self._save_state()
            except Exception as exc:
                # Nothing changes unless every shard took the new model and it is saved.
                self.model.restore(before)
                if isinstance(exc, OSError):
                    raise PeerUnavailableError(
                        f"the key holder cannot write its state ({exc.strerror or exc})"
                    ) from exc
                raise
            self._decryptor.check_rotation(self.upload_layout.num_blocks)

    def follow_ring(self, view: RingView) -> None:
        """Follow the coordinator's shard ring ``view`` (:meth:`.ModelPublisher.follow_ring`)."""
        with self._lock:
            self._publisher.follow_ring(view, self.layout if self.params is not None else None)

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
        if not self.settings.encrypted:
            return None
        return self._decryptor.challenge(self.commits.seed(round_))

    @property
    def detections(self) -> dict[str, dict[str, int]]:
        """Detected tamperings by shard, then by reason."""
        return self.suspects.detections

    @property
    def blamed(self) -> dict[str, str]:
        """Clients proven guilty, with what they did (excluded for good)."""
        return self.suspects.blamed

    def model_state(self) -> ModelState:
        """The model's version, size and last round, the tampering detected, the missed deadlines.

        The tampering is what was detected so far, the missed deadlines are the shards'.
        """
        return ModelState(
            version=self.version,
            num_params=0 if self.params is None else self.params.size,
            initialized=self.params is not None,
            last_round=self.last_round,
            detections=self.suspects.counts(),
            quarantined=tuple(self.quarantined),
            detection_reasons=self.suspects.reasons(),
            shard_misses=self.shard_misses.totals(),
            stalled=tuple(self.shard_misses.stalled),
            blamed=dict(self.blamed),
        )

    def clear_detections(self) -> None:
        """Forget every detection (the operator replaced the suspect shards); refusals stay."""
        with self._lock:
            self.suspects.clear()
            if self.params is not None:
                self._save_state()

    @property
    def quarantined(self) -> list[str]:
        """Shards caught tampering ``max_detections`` times or more."""
        return self.suspects.quarantined

    # ------------------------------------------------------------------ rounds
    def apply_round(
        self,
        round_: int,
        version: int,
        run_id: str = "",
        members: dict[str, bytes] | None = None,
        *,
        timer: RoundTimer | None = None,
    ) -> RoundResult:
        """Verify, decrypt and apply round ``round_``'s aggregates; publish the next version.

        ``timer`` counts the seconds of each phase of the call
        (:data:`fedps.round_timer.KEYHOLDER_PHASES`: fetch, verify, decrypt, apply, save,
        rotate, publish).

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
                    self._publisher.publish_applied(round_, self.layout)
                return cached
            if round_ in self._refused:
                raise PolicyError(f"round {round_} was refused before; it is never decrypted")
            self.suspects.check_none_quarantined(self._shards.view.nodes)
            if self.params is None:
                raise NotReadyError("the key holder has no model yet")
            timer = timer or RoundTimer()
            if version != self.version:
                raise PolicyError(
                    f"round {round_} trained version {version}, the model is at {self.version}"
                )
            if round_ <= self.last_round:
                raise PolicyError(f"round {round_} is not after the last applied round")
            phase = self.commits.phase(round_)
            expected = (run_id, version, self.context_id)
            if (phase.run_id, phase.version, phase.context_id) != expected:
                raise PolicyError(
                    f"round {round_} was committed to for another run, version or key generation"
                )
            layout = self.layout
            mask = self.mask(round_)
            contributors = set(members or {})
            while True:  # a request the policy refuses raises here, refusing nothing
                verifier = AggregateVerifier(
                    phase=phase,
                    contributors=contributors,
                    min_quorum=self.settings.min_quorum,
                    max_clients=self.settings.max_clients,
                    challenge=self.challenge(round_),
                    staleness=self.settings.staleness,
                    max_staleness=self.settings.max_staleness,
                    pad_seeds=self.commits.pad_seeds(round_),
                )
                try:
                    delta, manifests, top_up = self._decryptor.average(
                        verifier,
                        self._shards.fetch_aggregates(round_, verifier.contributors),
                        owner=self._shards.owner,
                        layout=self.upload_layout if mask is None else mask.packed,
                        timer=timer,
                    )
                    break
                except ShardStalledError:
                    raise  # no check failed: the round is applied once the shard answers
                except PolicyError as exc:
                    keys = self.keys
                    if isinstance(keys, JointKeys):  # no trace: canaries need the whole key
                        self._refuse(round_, refused := untraced_refusal(exc, round_))
                        raise refused from exc  # a failed sketch, untraced, counts for nobody
                    refusal, guilty = judge(  # who did it, on evidence (see .blame)
                        exc,
                        verifier,
                        keys=keys,
                        unpack=self._decryptor.unpack,
                        shards=self._shards,
                        suspects=self.suspects,
                        min_quorum=self.settings.min_quorum,
                    )
                    if refusal is None:  # only contributors, and nothing revealed: again
                        contributors -= guilty
                        continue
                    self._refuse(round_, refusal)
                    if isinstance(refusal, OffGridRefusalError):  # s took part: a new key
                        self._decryptor.retire(round_, self.last_round, self._store.save_keys)
                    raise refusal from exc
            if mask is not None:  # the packed average, back to the coordinates sent
                delta = mask.scatter(delta)
            before = self.model.snapshot()
            with timer.phase("apply"):
                round_closed = self.model.step(round_, delta, manifests, layout)
            result = RoundResult(
                round=round_,
                version=self.version,
                fewest_contributors=min(len(m) for m in manifests.values()),
                total_weight=sum(manifests[0].values()),
                update_norm=float(np.linalg.norm(delta)),
                sync_groups_applied=round_closed,
                contributors={c: w for m in manifests.values() for c, w in m.items()},
                noise_multiplier=self._decryptor.present_multiplier(len(manifests[0]), top_up),
                top_up_std=top_up,
            )
            self._released[round_] = result
            try:
                with timer.phase("save"):
                    self._save_state()  # the decision is durable before anything is published
            except OSError as exc:
                self.model.restore(before)
                del self._released[round_]
                message = (
                    f"the key holder cannot write its state ({exc.strerror or exc}); round "
                    f"{round_} is not applied, asking again applies it"
                )
                _log.error("%s", message)
                raise PeerUnavailableError(message) from exc
            if self._decryptor.rotation_due(self.last_round):
                with timer.phase("rotate"):
                    self._decryptor.rotate(self.last_round, self._store.save_keys)
            with timer.phase("publish"):
                self._publisher.publish_applied(round_, self.layout)
            _log.info(
                "applied round %d (%d+ contributors), published version %d",
                round_,
                result.fewest_contributors,
                self.version,
            )
            return result

    def _refuse(self, round_: int, exc: PolicyError) -> None:
        """Never decrypt ``round_``; count a detected tampering against its shard.

        Unless the proof quarantined the shard: the round is then decrypted only from a ring
        without it (:meth:`.Suspects.check_none_quarantined`), pushed there again.
        """
        if isinstance(exc, TamperingError):
            self.suspects.detected(round_, exc)
        if not (isinstance(exc, TamperingError) and exc.shard in self.suspects.quarantined):
            self._refused.add(round_)
        try:
            self._save_state()
        except OSError as exc:  # the check fails the same way if the round is asked again
            _log.error("round %d: cannot record the refusal (%s)", round_, exc.strerror or exc)

    # ------------------------------------------------------------------ durability
    def _save_state(self) -> None:
        """Write the state (:meth:`.StateStore.save`)."""
        assert self.params is not None
        state = KeyHolderState(
            model=self.model.snapshot(),
            released=self._released,
            refused=self._refused,
            detections=self.detections,
            blamed=self.blamed,
            key_context=self.context_id,
            key_since=self._decryptor.key_since,
        )
        self.last_saved = self._store.save(state)


def _commit_board(
    directory: Path,
    settings: KeyHolderSettings,
    public: PublicContext,
    secret: bytes,
    saved: np.ndarray | None,
) -> CommitBoard:
    """The commit board of a key holder under ``public`` whose saved model is ``saved``.

    Sized for the blocks an update sends (none before the first model), its commitments
    sketched modulo the key's modulus (none with encryption off).
    """
    modulus = public.modulus if settings.encrypted else 0
    model_blocks = (
        0 if saved is None else BlockLayout(saved.size, public.params.values_per_block).num_blocks
    )
    return CommitBoard(
        directory,
        secret=secret,
        num_blocks=sent_blocks(model_blocks, settings.density, settings.fields),
        modulus=modulus,
        sketch_count=sketch_count(modulus) if modulus else 0,
        max_staleness=settings.max_staleness if settings.staleness is not None else 0,
        weight_bounds=settings.weight_bounds,
        masked=settings.density < 1,
    )


def _require_sync(settings: KeyHolderSettings, groups: GroupPolicy | None) -> None:
    """Refuse client-level noise with a mixed policy: it sums synchronous rounds only."""
    if settings.client_noise is not None and groups is not None:
        raise InvalidArgumentError("client-level noise needs synchronous rounds")
