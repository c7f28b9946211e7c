"""An update on its way from the trainer to the shards.

Weighted, clipped, encrypted, committed and cut into signed push messages.

:class:`UpdatePipeline` takes a trained update (the model's delta) and

0. with ``compression.density`` below 1, keeps only the coordinates of the round's shared
   mask (:class:`fedps.sharding.sparse_mask.SparseMask`, from the seed the key holder releases
   with the round's challenge), packed densely, after adding what earlier rounds did not send
   (``compression.error_feedback``, :class:`clients.error_feedback.ErrorFeedback`);
1. weights it (:func:`aggregation_weight`: 1 with ``security.weighting = "uniform"``, the
   default; otherwise ``num_examples / weight_scale``, the cohort's largest ``num_examples``,
   at least ``security.min_weight``);
2. clips it to ``he.max_abs_value`` (the range the CKKS parameters were sized for); with
   ``compression.bits``, quantizes it to that many bits by stochastic rounding and packs
   several values to a coefficient (:class:`crypto.quantized_packing.QuantizedPacking`): what
   is encrypted, committed and sketched is the packed update;
3. encrypts it block by block under the key holder's public context, each block's ``c0``
   padded with the pad of the round's pad seed that the key holder gave this client alone
   (:mod:`crypto.blinding`: the key holder removes the pads of exactly the contributors it
   decrypts, so no other sum of the ciphertexts decrypts to anything);
4. commits to it at the key holder: the signed root of every encrypted block
   (:class:`crypto.signed_update.SignedUpdate`) and the sketch of every block under the
   round's secret challenge (:class:`crypto.sketch.Challenge`), before any ciphertext of the
   round reaches a shard (a sparsified update's commitment names its mask too);
5. returns the signed push messages per owning shard (:class:`PreparedPush`), which
   :class:`clients.pusher.Pusher` sends once the round's commitments are frozen.

Asynchronous rounds are buffers: an update whose buffer froze before it committed joins the
next one, as a stale update, and is encrypted again first if the key holder rotated its keys
in between (the next buffer names another public context).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from clients.client_session import ClientSession
from clients.error_feedback import ErrorFeedback
from clients.peer_failures import KEY_HOLDER, PeerFailures
from crypto import BlockEncryptor
from crypto.signed_update import SignedUpdate
from crypto.sketch import Challenge
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, RoundClosedError
from fedps.round_timer import RoundTimer
from fedps.rpc.keyholder_messages import RoundChallenge, UpdateCommitment
from fedps.rpc.shard_messages import PushBatch
from fedps.rpc.transport import batched
from fedps.sharding.sparse_mask import SparseMask, mask_seed

__all__ = ["PreparedPush", "UpdatePipeline", "aggregation_weight", "push_messages"]

_log = logging.getLogger("fedps")
_ASYNC_ATTEMPTS = 3  # the buffers an async update tries to commit to before it is dropped


@dataclass(frozen=True)
class PreparedPush:
    """A committed update's signed push messages, per shard (resent unchanged if asked)."""

    round: int
    version: int
    messages: dict[str, list[PushBatch]]


def push_messages(
    update: SignedUpdate, round_: int, context_id: str, blocks: dict[str, list[tuple[int, bytes]]]
) -> dict[str, list[PushBatch]]:
    """The push messages of ``blocks`` (``{shard: [(block, packed ciphertext)]}``) of ``update``.

    One stream per shard: its first message carries the signed commitment, the others take it
    from there (the block roots would otherwise cost 0.1 byte a parameter more).
    """
    return {
        sid: [
            PushBatch.carrying(
                update, round_=round_, context_id=context_id, blocks=batch, signed=i == 0
            )
            for i, batch in enumerate(batched(shard_blocks, lambda b: len(b[1])))
        ]
        for sid, shard_blocks in blocks.items()
    }


def aggregation_weight(config: FedPSConfig, num_examples: int, weight_scale: float) -> float:
    """The aggregation weight of an update trained on ``num_examples``.

    ``weight_scale`` is the round's: the cohort's largest ``num_examples``.
    """
    security = config.security
    if config.privacy.level == "client" or security.weighting == "uniform":
        return 1.0  # every client weighs the same (the key holder insists)
    share = num_examples / max(weight_scale, 1.0)
    return min(1.0, max(security.min_weight, share))


class UpdatePipeline:
    """Weight, clip, encrypt and commit a client's updates.

    Parameters
    ----------
    session
        The client's session: its signing key, its client and run ids, the key holder's
        channel and public context, and the ring that says which shard owns a block.
    failures
        Where the key holder's refusals of a commitment are counted.
    timer
        Times the encryption (``encrypt_offline``: the encryptions of zero drawn in the round;
        ``encrypt_online``: the encoding into them) and the commitment (``commit``).
    feedback
        The residual of sparsified updates (``compression.error_feedback``); None: the unsent
        coordinates are dropped.
    """

    def __init__(
        self,
        session: ClientSession,
        failures: PeerFailures,
        *,
        timer: RoundTimer | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.session = session
        self.failures = failures
        self.timer = timer or RoundTimer()
        self.feedback = feedback
        self._challenges: dict[int, RoundChallenge] = {}  # of the last round asked
        self._last_mask: SparseMask | None = None  # its coordinates are sorted once, not per use
        self._rounding = np.random.default_rng()  # stochastic rounding: post-processing

    def prepare(
        self, round_: int, version: int, delta: np.ndarray, *, weight: float
    ) -> PreparedPush | None:
        """Weight, clip, encrypt and commit an update.

        Returns the signed push messages per shard (None when the round's commitments had closed, or
        the key holder refused).
        """
        he = self.session.config.he
        self._challenges = {}  # asked afresh: a reopened round has another challenge
        mask: SparseMask | None = None
        total = delta
        if self.session.config.compression.enabled:
            mask = self._mask(round_)
            if mask is None:
                return None
            total = delta if self.feedback is None else self.feedback.add(delta)
            delta = mask.gather(total)
        weighted = delta * weight
        clipped = np.clip(weighted, -he.max_abs_value, he.max_abs_value)
        if not np.array_equal(clipped, weighted):
            _log.warning(
                "%s: update clipped to +-%g for encryption", self.session.name, he.max_abs_value
            )
        packing = self.session.packing
        if packing is not None:
            clipped = packing.pack(packing.quantize(clipped, self._rounding))
        with self.timer.phase("commit"):  # the encryption inside is timed apart
            committed = self._commit(round_, version, weight, clipped, mask)
        if committed is None:
            return None
        if mask is not None and self.feedback is not None:
            self.feedback.keep(total, mask.indices())  # sent: the rest waits for the next
        round_, update, encrypted = committed
        return self._messages(round_, version, update, encrypted)

    def training_mask(self, round_: int) -> np.ndarray | None:
        """The coordinates the client trains in ``round_`` (None: every one).

        With ``compression.masked_training``, those the round's mask sends (asked of the key
        holder before training): the rest of the model stays as pulled.
        """
        if not self.session.config.compression.masked_training:
            return None
        mask = self._mask(round_)
        return None if mask is None else mask.indices()

    def _mask(self, round_: int) -> SparseMask | None:
        """The shared mask of ``round_`` (None: the key holder did not give its seed)."""
        try:
            seed = self.challenge(round_).seed
        except FedPSError as exc:
            self.failures.failed(KEY_HOLDER, exc, expected=isinstance(exc, RoundClosedError))
            return None
        density = self.session.config.compression.density
        mask = SparseMask(self.session.upload_layout, density, mask_seed(seed))
        if mask != self._last_mask:  # masked training asked for it before prepare() does
            self._last_mask = mask
        return self._last_mask

    def challenge(self, round_: int) -> RoundChallenge:
        """``round_``'s challenge and pad seeds from the key holder (asked once per round)."""
        challenge = self._challenges.get(round_)
        if challenge is None:
            session = self.session
            challenge = session.keyholder.get_challenge(
                round_, session.client_id, retry_s=session.peer_wait_s
            )
            self._challenges = {round_: challenge}
        return challenge

    def _messages(
        self, round_: int, version: int, update: SignedUpdate, encrypted: dict[int, bytes]
    ) -> PreparedPush:
        """The committed blocks as push messages to the shards that own them."""
        ring = self.session.ring
        by_shard: dict[str, list[tuple[int, bytes]]] = {}
        for block, data in encrypted.items():
            by_shard.setdefault(ring.owner(block), []).append((block, data))
        messages = push_messages(update, round_, self.session.context_id, by_shard)
        return PreparedPush(round_, version, messages)

    def _commit(
        self,
        round_: int,
        version: int,
        weight: float,
        values: np.ndarray,
        mask: SparseMask | None = None,
    ) -> tuple[int, SignedUpdate, dict[int, bytes]] | None:
        """Encrypt the update's ``values`` and commit to them at the key holder.

        The commitment is the signed block roots (then the seed of ``mask``, the round's, when
        ``values`` are the coordinates it picked) and the sketches of the blocks under the
        round's challenge. Returns the round it committed to, the signed update and the encrypted
        blocks, or None when the round's commitments had closed (async: after trying the next
        buffers too, as a stale update; a buffer under a new key, the key holder having rotated
        its keys since, gets the values encrypted again under it).
        """
        session = self.session
        keyholder = session.keyholder
        attempts = _ASYNC_ATTEMPTS if session.config.training.mode == "async" else 1
        for attempt in range(attempts):
            try:
                # under this round's pads: a round the update moves to pads it afresh
                encrypted, coefficients = self._encrypt(values, round_)
                update = SignedUpdate.sign(
                    session.signer,
                    coefficients,
                    run_id=session.run_id,
                    round_=round_,
                    client_id=session.client_id,
                    context_id=session.context_id,
                    weight=weight,
                    version=version,
                    mask=b"" if mask is None else mask.root,
                )
                sketches = self._sketches(round_, coefficients)
                keyholder.commit(
                    UpdateCommitment(round_, update, sketches), retry_s=session.peer_wait_s
                )
                return round_, update, encrypted
            except RoundClosedError as exc:
                if attempt == attempts - 1:
                    self.failures.failed(KEY_HOLDER, exc, expected=True)
                    return None
                _log.info("%s: commitment refused: %s", session.name, exc)
            except FedPSError as exc:
                # e.g. we restarted mid-round with a new key: sit this round out
                self.failures.failed(KEY_HOLDER, exc)
                return None
            # Async: the buffer froze before we committed; the update joins the next one.
            following = session.next_train_task(round_)
            if following is None:
                return None
            if following.context_id not in ("", session.context_id):  # the keys rotated
                if not session.adopt_context(following.context_id):
                    return None
                _log.info(
                    "%s: the key holder rotated its keys; encrypting the update again for round %d",
                    session.name,
                    following.round,
                )
            round_ = following.round
        return None

    def _encrypt(self, values: np.ndarray, round_: int) -> tuple[dict[int, bytes], np.ndarray]:
        """``values`` encrypted under the current public context and ``round_``'s pads.

        The packed blocks and their coefficients. The encryptions of zero not drawn in the
        background yet are drawn first (the offline half, timed apart from the online half).
        """
        encryptor = self.session.encryptor
        padded = isinstance(encryptor, BlockEncryptor)  # encryption off: nothing to pad
        pad_seed = self.challenge(round_).pad_seed if padded else b""
        with self.timer.phase("encrypt_offline"):
            self.session.precompute(background=False)
        with self.timer.phase("encrypt_online"):
            if isinstance(encryptor, BlockEncryptor):
                return encryptor.encrypt_with_coefficients(values, pad_seed=pad_seed)
            return encryptor.encrypt_with_coefficients(values)

    def _sketches(self, round_: int, coefficients: np.ndarray) -> bytes:
        """The round's sketches of every encrypted block (none without encryption)."""
        session = self.session
        encryptor = session.encryptor
        if not isinstance(encryptor, BlockEncryptor):
            return b""
        seed = self.challenge(round_).seed
        public = encryptor.public
        challenge = Challenge(
            seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
        )
        return challenge.sketch(coefficients).astype("<u8").tobytes()
