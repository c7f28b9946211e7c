"""Zero canaries: no decryption the key holder releases carries key material.

A ciphertext ``(c0, c1)`` decrypts to ``c0 + c1*s = m + e`` (``e`` the small encryption
error). If anyone, a client on its own ciphertext or a shard on an aggregate, adds ``t`` to
``c1``, the decryption becomes ``m + e + t*s``: released, it hands out ``t*s`` and, with
``t`` known to the attacker, the secret key ``s``. Commitments cannot stop a client that
commits to the changed bytes itself.

Every block reserves :data:`crypto.params.CANARIES` plaintext coefficients (evenly spaced,
public) that honest clients encode as 0. Coefficient ``j`` of ``t*s`` is
``sum_i +-t_i s_(j-i)``: a linear form in every coefficient of ``s``. The key holder computes
the canaries alone (``K`` coefficients, nothing of the values) and refuses to decrypt a
block if one of them exceeds :func:`canary_bound`, a bound that an honest sum's error
``e`` exceeds with probability below 2^-120.

Why it holds (docs/security.md states it with numbers):

- For any change with a coefficient ``|t_i| > 3b`` (``b`` the bound), each canary alone
  passes with probability at most 1/3 over the ternary ``s`` that the attacker does not know
  (fix every other coefficient of ``s``: the three values of ``s_(j-i)`` move the canary by
  ``|t_i|`` give or take the tiny ``e1`` term, so at most one lands within ``[-b, b]``).
  For a change with one term, or terms ``N/K`` apart, the ``K`` canaries depend on distinct
  coefficients of ``s``: all pass with probability ``3^-K`` = 2^-50.7.
- A change that passes for sure (``sum |t_i| <= b``) moves every coefficient by at most
  ``b``, the size of the honest error itself, which the flooding of released sums
  (:mod:`crypto.release`, ``2^flood_bits`` times the error bound) hides as it hides ``e``.

The bound: ``e = e_pk * u + e0 + e1 * s`` for one fresh encryption (SEAL's ``u`` ternary,
``e0, e1`` centred binomial of 21 + 21 bits, ``e_pk`` the public key's error). Each is a sum of
independent bounded terms, sub-Gaussian with variance proxy ``||e_pk||^2 <= 14 N`` (its mean
is 10.5 N), ``21`` and ``21 * wt(s) <= 21 N``, so ``35 N + 21`` in all; a sum weighted by
integers ``m_i`` has ``sum m_i^2`` times that. Hoeffding: ``P(|e_j| > 13 sigma) <= 2 e^-84.5``.
"""

from __future__ import annotations

import math

import numpy as np

from crypto.params import CkksParams
from fedps.errors import PolicyError

__all__ = ["CANARY_SIGMAS", "CanaryError", "canary_bound", "failing_rows"]

#: The bound in sub-Gaussian standard deviations of an honest error.
CANARY_SIGMAS = 13.0


class CanaryError(PolicyError):
    """A canary of a decryption exceeds the noise bound: the ciphertext carries a change in
    ``c1`` (or a client encoded something there). Nothing of it is released.

    Parameters
    ----------
    rows
        Indices, in the batch checked, of the ciphertexts that failed.
    """

    def __init__(self, rows: list[int], message: str) -> None:
        super().__init__(message)
        self.rows = rows


def canary_bound(params: CkksParams, noise_weight: float) -> float:
    """The largest |canary| an honest sum ``sum m_i c_i`` may show (``noise_weight`` =
    ``sum m_i^2``; 1 for one ciphertext, the contributor count for a synchronous round)."""
    n = params.poly_modulus_degree
    return CANARY_SIGMAS * math.sqrt((35 * n + 21) * max(1.0, noise_weight))


def failing_rows(canaries: np.ndarray, bound: float) -> list[int]:
    """Rows of ``(B, K)`` centred canaries with any |value| above ``bound``."""
    if canaries.size == 0:
        return []
    return [int(r) for r in np.flatnonzero(np.abs(canaries).max(axis=1) > bound)]
