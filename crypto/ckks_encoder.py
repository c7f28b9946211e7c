"""Fixed-point encoding of real values into plaintext coefficients, with zero canaries.

fedps only adds ciphertexts, so it needs none of CKKS's slot structure: a value ``x`` is the
integer coefficient ``round(x * scale)`` modulo q, one value per coefficient, and a sum of
ciphertexts decrypts to the sum of the coefficients (plus a small decryption error). This is
CKKS's approximate arithmetic without the canonical embedding; it costs no FFT, and the
decryption error of one value is that of one coefficient (about sqrt(N) times smaller than a
slot's).

Every block keeps :data:`crypto.params.CANARIES` coefficients at zero (evenly spaced,
:attr:`crypto.params.CkksParams.canary_positions`). A ciphertext whose ``c1`` was changed by
``t`` decrypts to ``m + t*s``, and every coefficient of ``t*s`` mixes every coefficient of the
secret ``s``: the key holder checks the canaries before it releases anything
(:class:`crypto.canary.CanaryCheck`).
"""

from __future__ import annotations

import numpy as np

from crypto.params import CkksParams
from fedps.errors import InvalidArgumentError

__all__ = ["CkksEncoder"]

# float64 represents integers exactly below 2**53; keep encoded coefficients well inside.
_MAX_COEFF_BITS = 52


class CkksEncoder:
    """Batched encoder/decoder of blocks of ``params.values_per_block`` values.

    Parameters
    ----------
    params
        The scheme parameters (ring dimension, scale, canary positions).
    modulus
        The coefficient modulus q; :meth:`encode` returns coefficients in [0, q).
    """

    def __init__(self, params: CkksParams, modulus: int) -> None:
        self.n = params.poly_modulus_degree
        self.values_per_block = params.values_per_block
        self.scale = params.scale
        self.modulus = modulus
        self._values = np.array(params.value_positions, dtype=np.int64)
        self._canaries = np.array(params.canary_positions, dtype=np.int64)
        self._limit = min(2.0**_MAX_COEFF_BITS, modulus / 2) / self.scale

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Encode a (B, values_per_block) float array into (B, N) uint64 coefficients mod q.

        Raises
        ------
        InvalidArgumentError
            If the shape is wrong, a value is not finite, or a scaled value is too large
            to encode exactly.
        """
        if values.ndim != 2 or values.shape[1] != self.values_per_block:
            raise InvalidArgumentError(
                f"expected shape (B, {self.values_per_block}), got {values.shape}"
            )
        if not np.all(np.isfinite(values)):
            raise InvalidArgumentError("cannot encode NaN or infinite values")
        if values.size and float(np.abs(values).max()) >= self._limit:
            raise InvalidArgumentError(f"values must be below {self._limit:g} in magnitude")
        out = np.zeros((values.shape[0], self.n), dtype=np.int64)
        out[:, self._values] = np.rint(values * self.scale)
        out[out < 0] += self.modulus
        return out.view(np.uint64)

    def decode(self, centred: np.ndarray) -> np.ndarray:
        """(B, N) centred integer coefficients -> (B, values_per_block) real values."""
        if centred.ndim != 2 or centred.shape[1] != self.n:
            raise InvalidArgumentError(f"expected shape (B, {self.n}), got {centred.shape}")
        out: np.ndarray = centred[:, self._values].astype(np.float64) / self.scale
        return out
