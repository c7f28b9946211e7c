"""The one use of the secret key: a verified round's sum in, its released average out.

:meth:`Decryptor.average` has :class:`~.aggregate_verifier.AggregateVerifier` check every
block of a round's aggregates against the commitments as they stream in from the shards, and
only then

1. checks every zero canary of every block against the noise bound before anything is
   decrypted (:meth:`crypto.SecretContext.open`, :mod:`crypto.canary`): a change to ``c1``
   anywhere, by a client on its own ciphertext or by a shard, and nothing of the round is
   decrypted (:class:`CanaryFailureError` carries the failing rows to trace);
2. floods and rounds each decrypted sum (:func:`crypto.release.flood_and_round`, the IND-CPA^D
   mitigation for CKKS) and refuses it if it exceeds what its contributors' clipping allows;
3. at client level (DP-FedAvg), adds the missing shares of the noise when fewer than the
   cohort's n clients contributed, from a CSPRNG nobody else can regenerate, and divides by
   the fixed n instead of the count (McMahan et al. 2018's fixed-denominator estimator), so the
   released model is post-processing of a sum that carries the noise the accountant assumes;
   otherwise divides by the total weight.

It also owns the key pair's lifetime: every ``rotate_every_rounds`` rounds (10 by default) the
key holder replaces the pair once a round is applied (:meth:`Decryptor.rotate`): later rounds
encrypt under the new public context, and the old secret key is gone from memory and from
disk. One key then releases a bounded number of blocks, which bounds what changes that pass
the zero canaries can learn of it (:func:`crypto.release.releases_per_key`, docs/security.md),
and a key leaked by other means opens the ciphertexts of one period only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from crypto import PLAINTEXT_CONTEXT_ID, PlainContext, SecretContext, unpack_blocks
from crypto.blinding import Blinding
from crypto.canary import CanaryError
from crypto.quantized_packing import OffGridError
from crypto.randomness import SecureRandom
from crypto.release import (
    decryption_error_bound,
    flood_and_round,
    released_std,
    releases_per_key,
)
from crypto.sketch import Challenge
from fedps.errors import InvalidArgumentError, PolicyError
from fedps.round_timer import RoundTimer
from fedps.rpc.shard_messages import AggregatePart
from fedps.sharding.blocks import BlockLayout
from server.keyholder.aggregate_verifier import AggregateVerifier
from server.keyholder.joint_keys import JointKeys
from server.keyholder.keyholder_settings import KeyHolderSettings

__all__ = ["CanaryFailureError", "Decryptor", "OffGridRefusalError"]

_log = logging.getLogger("fedps")


class CanaryFailureError(CanaryError):
    """A canary check failed: the failing blocks with their aggregate rows, to trace."""

    def __init__(self, rows: list[int], message: str, aggregates: dict[int, np.ndarray]) -> None:
        super().__init__(rows, message)
        self.aggregates = aggregates
        self.blocks = sorted(aggregates)


class OffGridRefusalError(PolicyError):
    """A quantized sum refused as off its integer grid: a decision the secret key took part in.

    The key that answered it must answer no more (:meth:`KeyHolder.apply_round
    <server.keyholder.keyholder.KeyHolder.apply_round>` retires it at once), so one key tells at
    most which of its rounds was the first refused.
    """


class Decryptor:
    """Holds the key pair and releases the averages of verified sums.

    Parameters
    ----------
    keys
        The current key pair, or (key-holder parties) the joint public context and the parties
        that decrypt under it.
    settings
        The key holder's policy (encryption, flooding, clipping bound, client-level noise,
        rotation period).
    key_since
        The last round applied before ``keys`` were made (rotation counts from it).
    """

    def __init__(
        self, keys: SecretContext | JointKeys, settings: KeyHolderSettings, *, key_since: int = 0
    ) -> None:
        if settings.packing is not None and keys.public.params != settings.packing.params:
            raise InvalidArgumentError(
                "the key holder's keys were made for other CKKS parameters than "
                "compression.bits' packing; start it on a fresh state folder"
            )
        #: the current key pair (replaced by :meth:`rotate`)
        self.keys = keys
        #: the last round applied before :attr:`keys` were made
        self.key_since = key_since
        self._settings = settings
        self._noise = SecureRandom()  # the top-up: nobody else may be able to regenerate it

    @property
    def context_id(self) -> str:
        """The id clients must encrypt under (or the plaintext id, encryption off)."""
        return self.keys.public.context_id if self._settings.encrypted else PLAINTEXT_CONTEXT_ID

    def challenge(self, seed: bytes) -> Challenge:
        """The sketch challenge of ``seed`` under the current keys."""
        public = self.keys.public
        return Challenge(seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block)

    def block_sizes(self) -> frozenset[int]:
        """The sizes a packed aggregate block may have.

        The full form and the compressed one (:attr:`crypto.PublicContext.block_sizes`).
        """
        if not self._settings.encrypted:
            return frozenset({PlainContext(self.keys.public.params.values_per_block).block_bytes})
        return self.keys.public.block_sizes

    def unpack(self, data: list[bytes]) -> np.ndarray:
        """Validated coefficients of aggregate blocks (values, encryption off)."""
        if not self._settings.encrypted:
            return PlainContext(self.keys.public.params.values_per_block).unpack_blocks(data)
        return unpack_blocks(self.keys.public, data)

    # ------------------------------------------------------------------ release
    def average(
        self,
        verifier: AggregateVerifier,
        fetched: Mapping[str, Iterable[AggregatePart]],
        *,
        owner: Callable[[int], str],
        layout: BlockLayout,
        timer: RoundTimer | None = None,
    ) -> tuple[np.ndarray, dict[int, dict[str, float]], float]:
        """The round's weighted average update, each block's contributors, and the top-up noise.

        The contributors come with their effective weights (weight x staleness multiplier; a block's
        total is their sum); the noise is the std of the client-level top-up noise added to each
        value of the sum (0 without).

        Nothing is decrypted before every block of every shard (``fetched``: each shard's
        reply; ``owner``: the shard of each block) passed every check of ``verifier``. At
        client level the average divides the topped-up sum by the fixed cohort size.
        ``timer`` counts the wait for the shards' messages as ``fetch``, the checks as
        ``verify``, and the canaries, decryption, flooding and averaging as ``decrypt``.

        Raises
        ------
        PolicyError
            A check of ``verifier`` failed (a :class:`~.aggregate_verifier.TamperingError`
            names the shard), the sum cannot be decrypted, a decrypted sum exceeds the
            clipping bound, or a client-level round carries a weight that is not 1.
        CanaryFailureError
            A zero canary exceeds the noise bound: nothing is decrypted.
        """
        round_ = verifier.phase.round
        timer = timer or RoundTimer()
        if self._settings.encrypted and isinstance(self.keys, JointKeys):
            self.keys.prepare(round_, sorted(verifier.contributors))  # while this checks it
        streams = {sid: timer.iterate("fetch", parts) for sid, parts in fetched.items()}
        with timer.phase("verify"):
            blocks, rows = verifier.verify(
                streams,
                owner=owner,
                num_blocks=layout.num_blocks,
                block_sizes=self.block_sizes(),
                unpack=self.unpack,
            )
        multipliers = list(verifier.multipliers.values())
        effective = {
            c: verifier.weights[c] * verifier.multipliers[c] for c in verifier.contributors
        }
        total = sum(effective.values())
        top_up = 0.0
        noise = self._settings.client_noise
        if noise is not None:  # the sum of m shares: every weight and multiplier is 1
            if any(w != 1.0 for w in effective.values()):
                raise PolicyError("client-level DP sums unweighted updates; a weight is not 1")
            top_up = noise.top_up_std(len(effective))
            total = float(noise.cohort)
        with timer.phase("decrypt"):  # every block at once: one draw of noise, one check
            opened = self._open(round_, blocks, rows, verifier)
            summed = self._release(opened, multipliers, blocks)
            if top_up > 0:  # after the bound check, which covers the clients' values only
                summed = summed + self._noise.normal(top_up, summed.shape)
            averaged = dict(zip(blocks, summed / total, strict=True))
        manifests = {b: dict(effective) for b in averaged}
        return layout.join(averaged), manifests, top_up

    def present_multiplier(self, contributors: int, top_up: float) -> float:
        """The noise multiplier of a client-level round's released sum of ``contributors`` shares.

        0: example level, where the noise is each client's own DP-SGD.
        """
        noise = self._settings.client_noise
        if noise is None:
            return 0.0
        return noise.present_multiplier(contributors, top_up)

    def _unblind(
        self, rows: np.ndarray, blocks: Sequence[int], verifier: AggregateVerifier
    ) -> np.ndarray:
        """The verified sums less the contributors' pads (:mod:`crypto.blinding`).

        The pads cancel only in the sum of exactly the contributors, each as many times as its
        multiplier says; any other sum stays padded on every value coefficient, so that its
        decryption is uniform there and fails the bound or grid checks. The canaries carry no
        pad: what :meth:`_open` checks is unchanged.
        """
        public = self.keys.public
        return Blinding(public.params, public.modulus).remove(rows, blocks, verifier.pads())

    def _open(
        self, round_: int, blocks: list[int], rows: np.ndarray, verifier: AggregateVerifier
    ) -> np.ndarray:
        """Every block's decrypted sum, once every zero canary of every block is within bound.

        ``rows`` are the verified aggregates as the shards summed them, pads and all.

        The bound is the noise bound (:mod:`crypto.canary`): a change to ``c1`` anywhere, by a
        client on its own ciphertext or by a shard, and nothing of the round is decrypted.
        With key-holder parties, each party checks the joint canaries of ``contributors``'
        aggregate itself before it answers (:mod:`crypto.joint_canary`).
        """
        if not self._settings.encrypted:
            return rows
        unblinded = self._unblind(rows, blocks, verifier)
        contributors = sorted(verifier.contributors)
        try:
            if isinstance(self.keys, JointKeys):  # the parties check the shards' own sums
                c0 = unblinded[:, : self.keys.public.params.poly_modulus_degree]
                return self.keys.open_round(round_, contributors, blocks, rows, c0=c0)
            noise_weight = sum(m * m for m in verifier.multipliers.values())
            return self.keys.open(unblinded, noise_weight=noise_weight)
        except CanaryError as exc:
            failed = [blocks[r] for r in exc.rows]
            _log.warning(
                "round %d: blocks %s carry a change in c1 (a zero canary exceeds the noise "
                "bound); nothing of this sum is decrypted",
                round_,
                failed[:8],
            )
            raise CanaryFailureError(
                exc.rows,
                f"round {round_}: {len(failed)} block(s) carry key material ({exc})",
                {blocks[r]: rows[r] for r in exc.rows},
            ) from exc
        except InvalidArgumentError as exc:
            raise PolicyError(f"round {round_} cannot be decrypted: {exc}") from exc

    def _release(
        self, summed: np.ndarray, multipliers: Sequence[int], blocks: Sequence[int]
    ) -> np.ndarray:
        """Flood and round decrypted sums, then refuse them if one breaks the clipping bound.

        ``summed`` holds one row per block of ``blocks``, each a sum of ciphertexts weighted by
        integer ``multipliers`` (all 1 in sync rounds). Quantized packing rounds each sum to
        the integer it must be and unpacks it instead of flooding (:meth:`_unpack_fields`).
        """
        settings = self._settings
        margin = 0.0
        contributors = sum(multipliers)  # every value is at most this x max_abs_value
        if settings.packing is not None:  # exact integers: nothing of the error to flood
            summed = self._unpack_fields(summed, contributors, sum(m * m for m in multipliers))
        elif settings.encrypted and isinstance(self.keys, JointKeys):  # flooded by each party
            margin = self.keys.flooding_bound(sum(m * m for m in multipliers))
        elif settings.encrypted and settings.flood_bits > 0:
            # the error of sum m_i c_i grows with sqrt(sum m_i^2), not sqrt(sum m_i)
            sigma = 2.0**settings.flood_bits * decryption_error_bound(
                self.keys.public.params, sum(m * m for m in multipliers)
            )
            summed = flood_and_round(summed, sigma)
            margin = 8 * released_std(sigma)
        bound = contributors * settings.max_abs_value * (1 + 1e-6) + margin
        over = np.flatnonzero(np.abs(summed).max(axis=1, initial=0.0) > bound)
        if over.size:
            # (the decrypted value stays here: the message reaches the coordinator's logs)
            raise PolicyError(
                f"block {blocks[int(over[0])]}: a decrypted sum exceeds the bound that "
                f"{contributors} clients clipped to {settings.max_abs_value:g} allow; refusing "
                "to apply"
            )
        return summed

    def _unpack_fields(
        self, summed: np.ndarray, contributors: int, noise_weight: float
    ) -> np.ndarray:
        """Packed sums, rounded, split into their fields and dequantized (``(B, K V)`` values).

        Each sum is rounded to its integer, refused if it is farther from it than the proven
        decryption error (then nothing of the error is released: flooding has nothing to hide)
        or if a field overflowed (:meth:`crypto.quantized_packing.QuantizedPacking.unpack`).
        """
        packing = self._settings.packing
        assert packing is not None
        try:
            sums = packing.unpack(summed, contributors=contributors, noise_weight=noise_weight)
        except OffGridError as exc:
            raise OffGridRefusalError(f"{exc}; refusing to apply, and replacing the key") from exc
        except InvalidArgumentError as exc:
            raise PolicyError(f"{exc}; refusing to apply") from exc
        return packing.dequantize(sums, contributors)

    # ------------------------------------------------------------------ key rotation
    def rotation_due(self, last_round: int) -> bool:
        """Whether ``rotate_every_rounds`` rounds have passed since the key pair was made.

        In round numbers: a round abandoned in between counts too, which errs on the safe side.
        """
        period = self._settings.rotate_every_rounds
        if isinstance(self.keys, JointKeys) and not self.keys.can_rotate:
            return False  # parties in this process: nobody to generate a new key with
        return self._settings.encrypted and period > 0 and last_round - self.key_since >= period

    def retire(self, round_: int, last_round: int, save: Callable[[SecretContext], None]) -> None:
        """Replace the key pair that refused ``round_`` off its grid, a decision ``s`` took part in.

        A client can aim that decision at one coefficient of ``s`` (docs/crypto.md, *Quantized
        packing*), and it names nobody, so the client may ask every round: a refusal ends the
        key (:meth:`rotate`), which then tells at most which of its rounds was the first refused.
        """
        _log.warning(
            "round %d: a decrypted quantized sum was off its grid; replacing the key pair",
            round_,
        )
        self.rotate(last_round, save)

    def rotate(self, last_round: int, save: Callable[[SecretContext], None]) -> None:
        """Replace the key pair once round ``last_round`` is applied and saved.

        Later rounds encrypt under a new context; the old secret key is gone from memory and,
        through ``save`` (which writes the new pair in one step, :meth:`crypto.SecretContext.save`),
        from disk. A pair that cannot be written leaves the current one in use, and the next applied
        round tries again.
        """
        if isinstance(self.keys, JointKeys):  # a new collective generation (.party_rotation)
            if self.keys.rotate(last_round):
                self.key_since = last_round
                _log.info(
                    "rotated the parties' joint key after round %d; new context %s",
                    last_round,
                    self.keys.public.context_id[:12],
                )
            return
        keys = SecretContext.generate(self.keys.public.params)  # same parameters and layout
        try:
            save(keys)
        except OSError as exc:
            _log.error(
                "cannot write a new key pair (%s); the current keys stay in use, the next "
                "applied round tries again",
                exc.strerror or exc,
            )
            return
        self.keys, self.key_since = keys, last_round
        _log.info(
            "rotated the CKKS keys after round %d; new context %s",
            last_round,
            keys.public.context_id[:12],
        )

    def check_rotation(self, blocks: int) -> None:
        """Warn when one key pair may release more of the model's ``blocks`` blocks than is safe.

        That is, more than the leakage bound allows (:func:`crypto.release.releases_per_key`,
        docs/security.md).
        """
        if not self._settings.encrypted or isinstance(self.keys, JointKeys):
            return  # the parties' flooding (lambda_bits) hides what passes the joint canaries
        period = self._settings.rotate_every_rounds
        budget = releases_per_key(self.keys.public.params, self._settings.flood_bits)
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
