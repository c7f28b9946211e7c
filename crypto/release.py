"""Release hygiene for CKKS decryptions (IND-CPA^D mitigation).

Publishing a CKKS decryption leaks its error term, and with it information about the secret
key (Li and Micciancio, Eurocrypt 2021; Guo et al., USENIX Security 2024). Before a decrypted
aggregate leaves the key holder it is *flooded*: Gaussian noise of standard deviation
``sigma = 2**flood_bits * E`` is added, where ``E`` is a worst-case bound on the decryption
error of a sum of K fresh ciphertexts, and the result is rounded to a grid of ``sigma / 4``.
The released value minus the exact sum then has standard deviation
``sigma * sqrt(1 + 1/192)`` (flooding plus uniform rounding error), which the tests check.

Flooding also bounds what a change to ``c1`` that passes the zero canaries can carry out:
at most the canary bound ``b`` per coefficient, ``2^-8.5`` of ``sigma`` at the defaults.
Each released block then gives at most ``(b / (scale * sigma))^2`` of Fisher information per
coefficient of the secret key, even to an attacker who knows the honest sum, and
:func:`releases_per_key` is how many blocks one key may release before that adds up to
:data:`KEY_INFORMATION` (docs/security.md, "Key rotation").
"""

from __future__ import annotations

import math

import numpy as np

from crypto.canary import canary_bound
from crypto.params import NOISE_AT_N2048, CkksParams
from crypto.randomness import SecureRandom

__all__ = [
    "GRID_FRACTION",
    "KEY_INFORMATION",
    "decryption_error_bound",
    "flood_and_round",
    "released_std",
    "releases_per_key",
]

#: The rounding grid, as a fraction of the flooding standard deviation.
GRID_FRACTION = 0.25

#: The Fisher information per coefficient of the secret key that the releases of one key may
#: carry at most (a ternary coefficient's prior carries 1.5; 1 is a signal-to-noise ratio of 1).
KEY_INFORMATION = 1 / 16


def decryption_error_bound(params: CkksParams, contributors: int) -> float:
    """Worst-case |error| of one decrypted value of a sum of ``contributors`` ciphertexts."""
    noise = NOISE_AT_N2048 * math.sqrt(params.poly_modulus_degree / 2048)
    return noise * math.sqrt(max(1, contributors)) / params.scale


def released_std(sigma: float) -> float:
    """Standard deviation of (released - exact): flooding plus rounding to the grid."""
    grid = sigma * GRID_FRACTION
    return math.sqrt(sigma**2 + grid**2 / 12)


def flood_and_round(values: np.ndarray, sigma: float) -> np.ndarray:
    """Add N(0, sigma^2) noise from the CSPRNG and round to ``sigma / 4``.

    The CSPRNG is :class:`crypto.randomness.SecureRandom`.
    """
    if sigma <= 0:
        return values.copy()
    grid = sigma * GRID_FRACTION
    flooded = values + SecureRandom().normal(sigma, values.shape)
    out: np.ndarray = np.round(flooded / grid) * grid
    return out


def releases_per_key(params: CkksParams, flood_bits: int) -> int:
    """How many blocks one key pair may release.

    That is, before an attacker who knows every honest sum holds :data:`KEY_INFORMATION` per
    coefficient of the secret key (0 without flooding: nothing then hides a change below the canary
    bound).

    A change that passes the canaries moves each released value by at most ``b / scale``
    (:func:`crypto.canary.canary_bound`); flooding adds noise of ``sigma = 2^flood_bits E``
    (:func:`decryption_error_bound`). Both grow with ``sqrt(sum m_i^2)``, so their ratio
    ``r`` holds for any cohort, weighted or not; a block's release gives at most ``r^2`` of
    Fisher information per coefficient (the trace of ``T^T T / (scale sigma)^2`` for the
    change's negacyclic matrix ``T`` is ``N ||t||^2 / (scale sigma)^2 <= N r^2``).
    """
    if flood_bits <= 0:
        return 0
    sigma = 2.0**flood_bits * decryption_error_bound(params, 1) * params.scale
    ratio = canary_bound(params, 1) / sigma
    return int(KEY_INFORMATION / ratio**2)
