"""Public-key RLWE encryptions of zero, batched in numpy: what SEAL's ``encrypt_zero`` computes.

SEAL's asymmetric encryption of zero under a public key ``(pk0, pk1)`` with one prime ``q`` is

    u  <- uniform ternary polynomial ({-1, 0, 1} coefficients)
    e0, e1 <- centred binomial polynomials (21 + 21 bits per coefficient, sigma ~= 3.24)
    Enc(0) = (pk0 * u + e0,  pk1 * u + e1)   in Z_q[X] / (X^N + 1)

(SEAL 4 ``util::encrypt_zero_asymmetric`` with its default ``sample_poly_cbd``). Calling SEAL
once per ciphertext through its Python binding costs a serialisation round trip per
ciphertext; this module draws many at once:

- Randomness: a ChaCha20 keystream under a fresh 256-bit key from ``os.urandom`` for every
  draw (a CSPRNG, as the kernel's own); nothing is reused between draws.
- ``pk_i * u``: negacyclic products by a half-length complex FFT (evaluation at the roots of
  ``X^(N/2) = -i``, the same fold :class:`crypto.ckks_encoder.CkksEncoder` uses). ``pk_i`` is
  split into a low 23-bit limb and a high limb, so every limb product coefficient is an
  integer below ``N * 2^23`` and ``N * q / 2^23`` in magnitude, exact in float64 (rounding
  error ~1e-6 at N = 2048). The two are recombined in int64 without reduction, which is exact
  as long as ``|pk_i * u + e| <= N * q + 21 < 2^62``: :func:`supported` parameters only
  (the defaults: 2^57). A rounding distance above 0.25 raises (a sanity check; the bound is
  the guarantee).

Results are in coefficient (non-NTT) form, the form fedps sends. Tests check the products
against exact integer arithmetic and decrypt the ciphertexts with SEAL.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedps.errors import InvalidArgumentError

__all__ = ["ZeroEncryptor", "cbd21", "supported", "ternary"]

_LIMB_BITS = 23
_CBD_MASK = np.uint32((1 << 21) - 1)
_TERNARY = np.array([v % 3 - 1 for v in range(256)], dtype=np.float64)  # byte -> {-1, 0, 1}
_MAX_ROUNDING = 0.25
_CHUNK = 64  # ciphertexts per FFT batch: bounds the temporaries at ~10 MiB


def _keystream(size: int) -> bytes:
    """``size`` bytes of a ChaCha20 keystream under a fresh random key."""
    cipher = Cipher(algorithms.ChaCha20(os.urandom(32), os.urandom(16)), mode=None)
    return cipher.encryptor().update(bytes(size))


def ternary(count: int, n: int) -> np.ndarray:
    """``(count, n)`` uniform ternary coefficients as float64 (bytes 255 are rejected)."""
    need = count * n
    accepted = np.empty(0, dtype=np.uint8)
    while accepted.size < need:
        raw = np.frombuffer(_keystream(need - accepted.size + need // 64 + 64), dtype=np.uint8)
        accepted = np.concatenate([accepted, raw[raw < 255]])
    out: np.ndarray = _TERNARY[accepted[:need]].reshape(count, n)
    return out


def cbd21(shape: tuple[int, ...]) -> np.ndarray:
    """Centred binomial samples ``popcount(a) - popcount(b)`` of 21-bit ``a, b`` (int64)."""
    size = int(np.prod(shape))
    words = np.frombuffer(_keystream(8 * size), dtype=np.uint32).reshape(2, size)
    ones = np.bitwise_count(words & _CBD_MASK).astype(np.int64)
    out: np.ndarray = (ones[0] - ones[1]).reshape(shape)
    return out


def supported(n: int, modulus: int) -> bool:
    """Whether :class:`ZeroEncryptor` is exact for ring dimension ``n`` and prime ``modulus``."""
    return n * modulus < 1 << 62


class ZeroEncryptor:
    """Draws public-key encryptions of zero for one public key.

    Parameters
    ----------
    public_key
        The public key's two polynomials in coefficient form, shape ``(2, N)``, each
        coefficient below ``modulus``.
    modulus
        The prime q, with ``N * q < 2^62`` (:func:`supported`).
    """

    def __init__(self, public_key: np.ndarray, modulus: int) -> None:
        n = public_key.shape[-1]
        if public_key.shape != (2, n) or n < 4 or n & (n - 1):
            raise InvalidArgumentError(f"public key must have shape (2, N), got {public_key.shape}")
        if not supported(n, modulus):
            raise InvalidArgumentError(
                f"N * q must be below 2^62 (N = {n}, q of {modulus.bit_length()} bits)"
            )
        if int(public_key.max()) >= modulus:
            raise InvalidArgumentError("public key coefficients must lie below the modulus")
        self.n = n
        self.modulus = modulus
        half = n // 2
        self._twist = np.exp(-1j * np.pi * np.arange(half) / n)
        self._untwist = np.conj(self._twist)
        key = public_key.astype(np.int64)
        limbs = np.stack([key & ((1 << _LIMB_BITS) - 1), key >> _LIMB_BITS])  # (limb, poly, N)
        self._key_spectrum = np.fft.fft(self._fold(limbs.astype(np.float64)), axis=-1)

    def _fold(self, poly: np.ndarray) -> np.ndarray:
        """Real ``(..., N)`` -> complex ``(..., N/2)``: ``(a_j - i a_(j+N/2)) zeta^j``."""
        half = self.n // 2
        folded: np.ndarray = (poly[..., :half] - 1j * poly[..., half:]) * self._twist
        return folded

    def products(self, u: np.ndarray) -> np.ndarray:
        """``pk_i * u`` mod ``X^N + 1`` for ternary ``u`` of shape ``(count, N)``, not reduced.

        Returns int64 of shape ``(count, 2, N)``: the exact integer products, each of magnitude
        at most ``N * (q - 1) < 2^62`` (so a small error term can be added before one
        reduction).

        Raises
        ------
        ArithmeticError
            If a product coefficient is not within 0.25 of an integer (never expected: the
            limbs keep every value below 2^34).
        """
        count, half = u.shape[0], self.n // 2
        spectrum = np.fft.fft(self._fold(u), axis=-1)  # (count, N/2)
        # (limb, count, poly, N/2): every limb of both key polynomials times u
        folded = np.fft.ifft(self._key_spectrum[:, None, :, :] * spectrum[None, :, None, :])
        folded *= self._untwist
        exact = np.empty((2, count, 2, self.n), dtype=np.float64)
        np.rint(folded.real, out=exact[..., :half])
        np.rint(folded.imag, out=exact[..., half:])
        np.negative(exact[..., half:], out=exact[..., half:])
        worst = max(
            float(np.abs(folded.real - exact[..., :half]).max()),
            float(np.abs(folded.imag + exact[..., half:]).max()),
        )
        if worst > _MAX_ROUNDING:
            raise ArithmeticError(f"negacyclic product lost precision ({worst:.3f})")
        ints = exact.astype(np.int64)
        out: np.ndarray = ints[0] + (ints[1] << _LIMB_BITS)
        return out

    def draw(self, count: int) -> np.ndarray:
        """``count`` fresh encryptions of zero, shape ``(count, 2N)``, uint64 in ``[0, q)``.

        Each must encrypt exactly one block: ``Enc(m) = Enc(0) + (m, 0)``.
        """
        out = np.empty((count, 2 * self.n), dtype=np.uint64)
        for start in range(0, count, _CHUNK):
            size = min(_CHUNK, count - start)
            cipher = self.products(ternary(size, self.n))
            cipher += cbd21(cipher.shape)
            cipher %= self.modulus  # the only reduction: |pk * u + e| < 2^62
            out[start : start + size] = cipher.reshape(size, 2 * self.n)
        return out
