"""Linear sketches of ciphertexts: how the key holder checks a whole aggregate cheaply.

A sketch of a ciphertext block ``c`` (its 2N coefficients, both polynomials, in ``[0, q)``)
under a challenge vector ``r`` is ``<r, c> mod q``. It is linear: the sketch of a sum of
ciphertexts weighted by integers ``m_i`` is the same weighted sum of their sketches, so the
key holder can check that an aggregate ``A`` a shard hands it is ``sum m_i c_i`` from one
number per block and contributor, without ever seeing a ``c_i``.

Soundness. Let a shard hand over ``A = sum m_i c_i + D`` with ``D != 0`` chosen without
knowing ``r``. For a coefficient ``j`` with ``D_j != 0`` and every other entry of ``r`` fixed,
``<r, D> = 0 mod q`` holds for exactly one residue of ``r_j`` (q is prime). Entries of ``r``
are uniform 64-bit words, so each residue has probability at most ``1/q + 2^-64``; with
:func:`sketch_count` independent sketches the change passes with probability at most
``(1/q + 2^-64)^k <= 2^-40`` per round, whichever and however many coefficients it touches.

The products are exact: coefficients and challenge words are cut into 16-bit limbs, each
limb product summed over at most 2^15 coefficients stays below 2^53, so a float64 matrix
product (BLAS) computes every partial sum exactly; they are recombined modulo q in integers.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from fedps.errors import InvalidArgumentError

__all__ = [
    "SECURITY_BITS",
    "Challenge",
    "sketch_count",
]

#: A change to an aggregate passes the check with probability at most 2^-SECURITY_BITS.
SECURITY_BITS = 40
_LIMB = 16
_ROWS_PER_PASS = 64  # blocks sketched together (bounds the float64 temporaries)


def sketch_count(modulus: int) -> int:
    """Independent sketches per block needed for :data:`SECURITY_BITS` against ``modulus``."""
    per_sketch = -math.log2(1.0 / modulus + 2.0**-64)
    return max(1, math.ceil(SECURITY_BITS / per_sketch))


class Challenge:
    """The challenge vectors of one round, expanded from a 32-byte seed.

    Parameters
    ----------
    seed
        32 secret random bytes (the key holder derives them per round).
    modulus
        The ciphertext modulus q (prime).
    coeffs_per_block
        Coefficients of one ciphertext block (2N).
    """

    def __init__(self, seed: bytes, *, modulus: int, coeffs_per_block: int) -> None:
        if len(seed) != 32:
            raise InvalidArgumentError("a challenge seed is 32 bytes")
        if not 2 <= modulus < 1 << 62 or not 0 < coeffs_per_block <= 1 << 15:
            raise InvalidArgumentError("unsupported modulus or block size for sketches")
        self.seed = seed
        self.modulus = modulus
        self.count = sketch_count(modulus)
        self.coeffs_per_block = coeffs_per_block
        stream = hashlib.shake_256(b"fedps-sketch-v1" + seed).digest(
            8 * self.count * coeffs_per_block
        )
        words = np.frombuffer(stream, dtype="<u8").reshape(self.count, coeffs_per_block)
        # (coefficients, count * 4 limbs): column s*4 + b is limb b of challenge s.
        limbs = [(words >> np.uint64(_LIMB * b)) & np.uint64(0xFFFF) for b in range(4)]
        self._r = (
            np.stack(limbs, axis=2)
            .transpose(1, 0, 2)
            .reshape(coeffs_per_block, 4 * self.count)
            .astype(np.float64)
        )
        self._c_limbs = math.ceil(modulus.bit_length() / _LIMB)
        # 2^(16 (a + b)) mod q for coefficient limb a and challenge limb b
        self._weights = [
            [pow(2, _LIMB * (a + b), modulus) for b in range(4)] for a in range(self._c_limbs)
        ]

    def sketch(self, coefficients: np.ndarray) -> np.ndarray:
        """Sketches of each row of ``coefficients``; returns uint64 of shape (count, blocks).

        ``coefficients`` are uint64, shape (blocks, 2N), every value below q.
        """
        if (
            coefficients.dtype != np.uint64
            or coefficients.ndim != 2
            or coefficients.shape[1] != self.coeffs_per_block
        ):
            raise InvalidArgumentError(
                f"sketches need uint64 rows of {self.coeffs_per_block} coefficients"
            )
        blocks = coefficients.shape[0]
        out = np.zeros((self.count, blocks), dtype=np.uint64)
        for start in range(0, blocks, _ROWS_PER_PASS):
            rows = coefficients[start : start + _ROWS_PER_PASS]
            out[:, start : start + len(rows)] = self._sketch_rows(rows)
        return out

    def _sketch_rows(self, rows: np.ndarray) -> np.ndarray:
        q = self.modulus
        n = len(rows)
        # (limbs of c) x (coefficients) @ (coefficients) x (count * 4 limbs of r): exact sums
        c_limbs = np.concatenate(
            [((rows >> np.uint64(_LIMB * a)) & np.uint64(0xFFFF)) for a in range(self._c_limbs)]
        ).astype(np.float64)
        partial = (c_limbs @ self._r).reshape(self._c_limbs, n, self.count, 4)
        exact = partial.astype(np.uint64)  # every entry is an integer below 2^47
        out = np.zeros((self.count, n), dtype=object)
        for a in range(self._c_limbs):
            for b in range(4):
                terms = exact[a, :, :, b].T.astype(object)
                out += terms * self._weights[a][b]
        return np.array(out % q, dtype=np.uint64)

    def combine(self, sketches: list[tuple[np.ndarray, int]]) -> np.ndarray:
        """``sum m_i * s_i mod q``: what the aggregate's sketch must equal.

        Of contributors' sketches ``s_i`` (uint64, (count, blocks)) with integer multipliers
        ``m_i``.
        """
        if not sketches:
            raise InvalidArgumentError("no sketches to combine")
        total = np.zeros(sketches[0][0].shape, dtype=object)
        for values, multiplier in sketches:
            total += values.astype(object) * int(multiplier)
        return np.array(total % self.modulus, dtype=np.uint64)
