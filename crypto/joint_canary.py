"""Zero canaries under a joint key, checked by every party before any full partial leaves it.

A single key holder computes the canaries of an aggregate itself (:mod:`crypto.canary`) and
refuses a change ``t`` to ``c1`` before anything is decrypted. Under a joint key nobody holds
``s``: the canaries must be decrypted jointly, and a canary of a changed ciphertext *is* key
material (``(t s)_k``). Decrypting the 32 canaries of every block would hand whoever sees them
32 linear forms of ``s`` per changed block: the whole key from one round of a 534-block model.

So the parties decrypt only the canaries of :data:`COMBINATIONS` random combinations of the
aggregate's blocks, ``C^(k) = sum_b r_kb A_b`` with weights ``r_kb`` uniform in
``[1, 2^WEIGHT_BITS]`` (:func:`canary_weights`: SHAKE-256 of the aggregate's digest, which the
clients fixed by their commitments before any ciphertext was revealed, so nobody can choose
the aggregate after the weights). Each party ``j`` returns the canaries of ``C1^(k) lambda_j
sh_j`` flooded with std :attr:`CanaryCheck.sigma` (:meth:`CanaryCheck.partial`), signed; each
party adds them to ``C0^(k)`` at the canaries and checks the bound itself
(:meth:`CanaryCheck.verify`) before it releases its full partial decryption.

- **Honest**: ``sum_b r_kb e_b`` has proxy ``sum_b r_kb^2`` times a block's, so the bound is
  :func:`crypto.threshold.joint_canary_bound` at that weight, plus 13 ``sqrt(T)`` floods and
  the parties' rounding: an honest aggregate fails with probability below 2^-120 per value.
- **Changed**: ``sum_b r_kb (t_b s)`` at the canaries. Changes cannot cancel across blocks
  without guessing the weights (``2^-8`` per combination, ``2^-48`` for all six). A change
  that passes for sure is at most ``bound / 2^8`` per coefficient of ``t_b s``: 2^26.9 at
  K = 100 and 534 blocks, ``2^-7.6`` of the parties' flooding of the released values
  (2^34.5 at lambda = 16, T = 2), which hides it as it hides the decryption error.
- **What it reveals**: ``6 x 32`` flooded values per round, not 32 per block; of a changed
  aggregate, 192 noisy linear forms of ``s`` per refused round (docs/crypto.md).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from crypto import rlwe
from crypto.canary import CanaryError
from crypto.params import TAIL_SIGMAS, CkksParams
from crypto.randomness import SecureRandom
from crypto.threshold import KeyShare, combine, flood, joint_canary_bound, weighted_share
from fedps.errors import InvalidArgumentError

__all__ = ["COMBINATIONS", "FLOOD_BITS", "WEIGHT_BITS", "CanaryCheck", "canary_weights"]

#: Random combinations of the blocks whose canaries are decrypted.
COMBINATIONS = 6
#: Bits of each combination weight (uniform in ``[1, 2^WEIGHT_BITS]``).
WEIGHT_BITS = 8
#: Each canary partial is flooded with ``2^(FLOOD_BITS - 1)`` times the honest bound.
FLOOD_BITS = 4

_WEIGHT_DOMAIN = b"fedps-joint-canary-weights-v1"


def canary_weights(aggregate: bytes, blocks: int) -> np.ndarray:
    """The weights ``r_kb``, ``(COMBINATIONS, blocks)`` int64 in ``[1, 2^WEIGHT_BITS]``.

    SHAKE-256 of the aggregate's digest (:func:`crypto.threshold.aggregate_digest`).
    """
    stream = hashlib.shake_256(_WEIGHT_DOMAIN + aggregate).digest(COMBINATIONS * blocks)
    words = np.frombuffer(stream, dtype=np.uint8).astype(np.int64)
    out: np.ndarray = (words + 1).reshape(COMBINATIONS, blocks)
    return out


def _combine_blocks(weights: np.ndarray, polys: np.ndarray, modulus: int) -> np.ndarray:
    """``sum_b r_kb poly_b mod q``, ``(COMBINATIONS, width)`` uint64 of ``(B, width)`` ones.

    One float64 matrix product of the coefficients' four 16-bit limbs: each limb sum is an
    integer below ``B 2^(WEIGHT_BITS + 16) < 2^53``, exact; the limbs are recombined modulo q
    (in int64: ``q < 2^55``).
    """
    if len(polys) >= 1 << (52 - WEIGHT_BITS - 16) or modulus >= 1 << 55:
        raise InvalidArgumentError(f"cannot combine {len(polys)} blocks modulo q exactly")
    blocks, width = polys.shape
    limbs = np.ascontiguousarray(polys, dtype="<u8").view("<u2").reshape(blocks, 4 * width)
    sums = (weights.astype(np.float64) @ limbs.astype(np.float64)).astype(np.int64)
    sums = sums.reshape(len(weights), width, 4) % modulus  # limb last, lowest first
    out = np.zeros(sums.shape[:2], dtype=np.int64)
    for k in range(3, -1, -1):  # Horner in 2^16, in two steps of 2^8 that stay below 2^63
        out = ((((out << 8) % modulus) << 8) + sums[..., k]) % modulus
    return out.astype(np.uint64)


@dataclass(frozen=True)
class CanaryCheck:
    """The joint canary check of one aggregate, as every party and the combiner compute it.

    Parameters
    ----------
    params
        The scheme parameters.
    parties
        P, the parties of the joint key.
    threshold
        T, how many decrypt together.
    noise_weight
        ``sum m_i^2`` of the aggregate's integer weights (its contributor count in a
        synchronous round).
    aggregate
        The aggregate's digest (:func:`crypto.threshold.aggregate_digest`).
    blocks
        How many blocks the aggregate has.
    """

    params: CkksParams
    parties: int
    threshold: int
    noise_weight: float
    aggregate: bytes
    blocks: int

    @cached_property
    def weights(self) -> np.ndarray:
        """The combination weights (:func:`canary_weights`)."""
        return canary_weights(self.aggregate, self.blocks)

    @cached_property
    def honest_bound(self) -> float:
        """The largest ``|sum_b r_kb e_b|`` at a canary, over the combinations."""
        heaviest = float((self.weights.astype(np.float64) ** 2).sum(axis=1).max())
        return joint_canary_bound(self.params, self.noise_weight * heaviest, self.parties)

    @property
    def sigma(self) -> float:
        """Each party's flooding of its canary partials."""
        return 2.0 ** (FLOOD_BITS - 1) * self.honest_bound

    @property
    def bound(self) -> float:
        """The check: honest error, ``T`` floods at 13 sigmas and their rounding."""
        flood = TAIL_SIGMAS * math.sqrt(self.threshold) * self.sigma
        return self.honest_bound + flood + self.threshold

    def partial(self, share: KeyShare, c1: np.ndarray, participants: Sequence[int]) -> np.ndarray:
        """Party ``share.index``'s flooded canaries of ``C1^(k) lambda_j sh_j``, ``(k, 32)``.

        ``c1`` is the aggregate's ``(B, N)`` second polynomials. :meth:`product`, then
        :meth:`flooded`.
        """
        return self.flooded(self.product(share, c1, participants), share.modulus)

    def product(self, share: KeyShare, c1: np.ndarray, participants: Sequence[int]) -> np.ndarray:
        """The canaries of ``C1^(k) lambda_j sh_j``, ``(k, 32)``, unflooded: never released so.

        What a party computes ahead of a round's checks (:meth:`flooded` once they passed).
        """
        self._check_rows(c1, share.modulus)
        weighted = weighted_share(share, participants)
        combined = _combine_blocks(self.weights, c1, share.modulus)
        canaries = list(self.params.canary_positions)
        product: np.ndarray = rlwe.RingProduct(weighted, share.modulus).times(combined)
        return product[:, canaries]

    def flooded(self, product: np.ndarray, modulus: int) -> np.ndarray:
        """``product`` (of :meth:`product`) with this check's flooding :attr:`sigma` added."""
        return flood(product, SecureRandom().normal(self.sigma, product.shape), modulus)

    def verify(self, c0: np.ndarray, partials: Sequence[np.ndarray], modulus: int) -> None:
        """Check ``C0^(k) + sum_j p_j`` at the canaries against :attr:`bound`.

        ``c0`` is the aggregate's ``(B, N)`` first polynomials; ``partials`` are the ``T``
        parties' :meth:`partial` answers.

        Raises
        ------
        CanaryError
            A combination's canary exceeds the bound: ``c1`` carries a change somewhere.
        """
        self._check_rows(c0, modulus)
        canaries = list(self.params.canary_positions)
        combined = _combine_blocks(self.weights, c0[:, canaries], modulus)
        values = combine(combined, partials, modulus)
        worst = float(np.abs(values).max(initial=0))
        if worst > self.bound:
            failed = [int(k) for k in np.flatnonzero(np.abs(values).max(axis=1) > self.bound)]
            raise CanaryError(
                failed,
                f"a joint canary is {worst:.3g} beyond the bound {self.bound:.3g}: the "
                "aggregate carries a change in c1; nobody releases a partial decryption of it",
            )

    def _check_rows(self, rows: np.ndarray, modulus: int) -> None:
        n = self.params.poly_modulus_degree
        if rows.shape != (self.blocks, n) or rows.dtype != np.uint64:
            raise InvalidArgumentError(f"expected ({self.blocks}, {n}) uint64 coefficients")
        if rows.size and int(rows.max()) >= modulus:
            raise InvalidArgumentError("a coefficient is not below the modulus")
