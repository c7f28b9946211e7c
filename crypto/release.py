"""Release hygiene for CKKS decryptions (IND-CPA^D mitigation).

Publishing a CKKS decryption leaks its error term, and with it information about the secret
key (Li and Micciancio, Eurocrypt 2021; Guo et al., USENIX Security 2024). Before a decrypted
aggregate leaves the key holder it is *flooded*: Gaussian noise of standard deviation
``sigma = 2**flood_bits * E`` is added, where ``E`` is a worst-case bound on the decryption
error of a sum of K fresh ciphertexts, and the result is rounded to a grid of ``sigma / 4``.
The released value minus the exact sum then has standard deviation
``sigma * sqrt(1 + 1/192)`` (flooding plus uniform rounding error), which the tests check.
"""

from __future__ import annotations

import math

import numpy as np

from crypto.params import NOISE_AT_N2048, CkksParams
from crypto.randomness import SecureRandom

__all__ = ["GRID_FRACTION", "decryption_error_bound", "flood_and_round", "released_std"]

#: The rounding grid, as a fraction of the flooding standard deviation.
GRID_FRACTION = 0.25


def decryption_error_bound(params: CkksParams, contributors: int) -> float:
    """Worst-case |error| of one decrypted value of a sum of ``contributors`` ciphertexts."""
    noise = NOISE_AT_N2048 * math.sqrt(params.poly_modulus_degree / 2048)
    return noise * math.sqrt(max(1, contributors)) / params.scale


def released_std(sigma: float) -> float:
    """Standard deviation of (released - exact): flooding plus rounding to the grid."""
    grid = sigma * GRID_FRACTION
    return math.sqrt(sigma**2 + grid**2 / 12)


def flood_and_round(values: np.ndarray, sigma: float) -> np.ndarray:
    """Add N(0, sigma^2) noise from the CSPRNG (:class:`crypto.randomness.SecureRandom`) and
    round to ``sigma / 4``."""
    if sigma <= 0:
        return values.copy()
    grid = sigma * GRID_FRACTION
    flooded = values + SecureRandom().normal(sigma, values.shape)
    out: np.ndarray = np.round(flooded / grid) * grid
    return out
