"""A key-holder party's partial decryptions, round after round, at a single key holder's pace.

:func:`crypto.threshold.partial_decryption` computes ``d_j = c1 (lambda_j sh_j) + e'_j`` from
scratch; a party that decrypts a round's aggregate after another computes the same values
faster:

- the product by SEAL's NTT (:class:`crypto.seal_ring_product.SealRingProduct`), its factor
  ``lambda_j sh_j`` in NTT form kept for each set of participants (there are at most
  ``C(P, T)``);
- the flooding ``e'_j`` drawn ahead: a :class:`crypto.noise_pool.NoisePool` draws the next
  round's standard Gaussians (one per coefficient of the last aggregate's shape) on a
  low-priority thread after each partial, and the partial takes them, times the round's
  std, then rounds them. Every value is a draw of :class:`crypto.randomness.SecureRandom`'s
  hardened Gaussian, handed out once and never kept, as the clients' DP noise
  (docs/privacy.md); a pool that has none ready (the first round, another shape) draws them
  then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from crypto.noise_pool import NoiseDraw, NoisePool
from crypto.public_context import PublicContext
from crypto.randomness import SecureRandom
from crypto.seal_ring_product import SealRingProduct
from crypto.threshold import KeyShare, flood, weighted_share
from fedps.errors import InvalidArgumentError

__all__ = ["PartialDecryptor"]


class PartialDecryptor:
    """Party ``share.index``'s partial decryptions (:func:`crypto.threshold.partial_decryption`).

    Parameters
    ----------
    share
        The party's share of the joint secret key.
    public
        The joint public context (N and q of every aggregate).
    noise
        Where the flooding comes from, drawn ahead (a pool of :class:`SecureRandom` when left
        out, of the pool's default bound: one round of a 30M-parameter model; one whose source
        is not secure draws nothing ahead).
    """

    def __init__(
        self, share: KeyShare, public: PublicContext, *, noise: NoisePool | None = None
    ) -> None:
        if share.modulus != public.modulus:
            raise InvalidArgumentError("the key share is not of this public context's modulus")
        self.share = share
        self._public = public
        self._noise = noise or NoisePool(SecureRandom())
        self._products: dict[tuple[int, ...], SealRingProduct] = {}

    def decrypt(self, c1: np.ndarray, *, participants: Sequence[int], sigma: float) -> np.ndarray:
        """``c1 (lambda_j sh_j) + e'_j mod q`` for ``c1`` of shape ``(B, N)``, uint64.

        As :func:`crypto.threshold.partial_decryption`, whose checks it makes; then the next
        round's flooding starts being drawn. :meth:`product` then :meth:`flooded`.

        Raises
        ------
        InvalidArgumentError
            The participants are not ``T`` distinct parties including this one, ``c1`` is
            not ``(B, N)`` below q, or ``sigma`` is negative or not finite.
        """
        _check_sigma(sigma)
        return self.flooded(self.product(c1, participants=participants), sigma=sigma)

    def product(self, c1: np.ndarray, *, participants: Sequence[int]) -> np.ndarray:
        """``c1 (lambda_j sh_j) mod q``, unflooded: never to leave the party as it is.

        What a party computes ahead of a round's checks (and floods with :meth:`flooded` once
        they passed).

        Raises
        ------
        InvalidArgumentError
            The participants are not ``T`` distinct parties including this one, or ``c1`` is
            not ``(B, N)`` below q.
        """
        return self._product(participants).times(c1)

    def flooded(self, product: np.ndarray, *, sigma: float) -> np.ndarray:
        """``product + e'_j mod q``: the flooding of std ``sigma`` added; then the next drawn.

        Raises
        ------
        InvalidArgumentError
            ``sigma`` is negative or not finite.
        """
        _check_sigma(sigma)
        unit = self._noise.normal(1.0, product.shape)
        unit *= sigma
        out = flood(product, unit, self.share.modulus)
        self._noise.fill([NoiseDraw(1.0, product.shape, np.float64)])
        return out

    def wait_drawn(self, timeout_s: float) -> bool:
        """Wait until the next round's flooding is drawn, at most ``timeout_s``; whether so."""
        return self._noise.wait(timeout_s)

    def close(self) -> None:
        """Stop drawing ahead and drop what was drawn."""
        self._noise.close()

    def _product(self, participants: Sequence[int]) -> SealRingProduct:
        """The product by ``lambda_j sh_j`` for ``participants``, made once per set."""
        key = tuple(sorted(participants))
        weighted = weighted_share(self.share, participants)  # checks the participants
        if key not in self._products:
            self._products[key] = SealRingProduct(self._public, weighted)
        return self._products[key]


def _check_sigma(sigma: float) -> None:
    if not (math.isfinite(sigma) and sigma >= 0):
        raise InvalidArgumentError(f"a flooding std is finite and >= 0, got {sigma}")
