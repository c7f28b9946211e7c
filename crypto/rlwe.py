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
  ``X^(N/2) = -i``: a real product of length N folded into one complex FFT). ``pk_i`` is
  split into a low 23-bit limb and a high limb, so every limb product coefficient is an
  integer below ``N * 2^23`` and ``N * q / 2^23`` in magnitude, exact in float64 (rounding
  error ~1e-6 at N = 2048). The two are recombined in int64 without reduction, which is exact
  as long as ``|pk_i * u + e| <= N * q + 21 < 2^62``: :func:`supported` parameters only
  (the defaults: 2^57). A rounding distance above 0.25 raises (a sanity check; the bound is
  the guarantee).

Results are in coefficient (non-NTT) form, the form fedps sends. Tests check the products
against exact integer arithmetic and decrypt the ciphertexts with SEAL. The same products by
the ternary secret key (:class:`TernaryProduct`) are how the key holder decrypts.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedps.errors import InvalidArgumentError

__all__ = [
    "RingProduct",
    "TernaryProduct",
    "ZeroEncryptor",
    "cbd21",
    "supported",
    "ternary",
    "uniform",
]

_LIMB_BITS = 23
_CBD_MASK = np.uint32((1 << 21) - 1)
_TERNARY = np.array([v % 3 - 1 for v in range(256)], dtype=np.float64)  # byte -> {-1, 0, 1}
_MAX_ROUNDING = 0.25
_CHUNK = 64  # ciphertexts per FFT batch: bounds the temporaries at ~10 MiB
_RING_LIMB_BITS = 12  # RingProduct's limbs: a degree's limb products sum to < limbs N 2^24


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


def uniform(
    count: int, n: int, modulus: int, source: Callable[[int], bytes] | None = None
) -> np.ndarray:
    """``(count, n)`` coefficients uniform in ``[0, modulus)``, uint64, by rejection.

    ``source(size)`` gives the next ``size`` random bytes (a fresh ChaCha20 keystream when
    left out; a seeded extendable-output function for a common polynomial everyone derives).
    """
    need = count * n
    mask = np.uint64((1 << modulus.bit_length()) - 1)
    take = source or _keystream
    accepted = np.empty(0, dtype=np.uint64)
    while accepted.size < need:
        words = np.frombuffer(take(8 * (need - accepted.size + 16)), dtype="<u8") & mask
        accepted = np.concatenate([accepted, words[words < np.uint64(modulus)]])
    out: np.ndarray = accepted[:need].reshape(count, n)
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


class _Negacyclic:
    """Exact negacyclic products in Z[X] / (X^N + 1) by a half-length complex FFT.

    Of a limb-split polynomial (each coefficient below 2^23) and a ternary one.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        half = n // 2
        self._twist = np.exp(-1j * np.pi * np.arange(half) / n)
        self._untwist = np.conj(self._twist)

    def spectrum(self, poly: np.ndarray) -> np.ndarray:
        """Real ``(..., N)`` -> the FFT of ``(a_j - i a_(j+N/2)) zeta^j``, ``(..., N/2)``."""
        half = self.n // 2
        folded = (poly[..., :half] - 1j * poly[..., half:]) * self._twist
        out: np.ndarray = np.fft.fft(folded, axis=-1)
        return out

    def combine(self, product_spectrum: np.ndarray) -> np.ndarray:
        """The limb products back from their spectrum, shape ``(2, ..., N)`` (limb first).

        Recombined exactly in int64 (``low + high << 23``), not reduced.
        """
        ints = self.exact(product_spectrum)
        out: np.ndarray = ints[0] + (ints[1] << _LIMB_BITS)
        return out

    def exact(self, product_spectrum: np.ndarray) -> np.ndarray:
        """The integer products whose spectrum is ``product_spectrum``, ``(..., N)`` int64.

        Raises
        ------
        ArithmeticError
            If a product coefficient is not within 0.25 of an integer (never expected: the
            limbs keep every value far below 2^50).
        """
        half = self.n // 2
        folded = np.fft.ifft(product_spectrum)
        folded *= self._untwist
        exact = np.empty((*folded.shape[:-1], self.n), dtype=np.float64)
        np.rint(folded.real, out=exact[..., :half])
        np.rint(folded.imag, out=exact[..., half:])
        np.negative(exact[..., half:], out=exact[..., half:])
        worst = max(
            float(np.abs(folded.real - exact[..., :half]).max()),
            float(np.abs(folded.imag + exact[..., half:]).max()),
        )
        if worst > _MAX_ROUNDING:
            raise ArithmeticError(f"negacyclic product lost precision ({worst:.3f})")
        ints: np.ndarray = exact.astype(np.int64)
        return ints


def _limbs(poly: np.ndarray) -> np.ndarray:
    """Coefficients below 2^46 as two float64 limbs of 23 bits, limb first."""
    ints = poly.astype(np.int64)
    return np.stack([ints & ((1 << _LIMB_BITS) - 1), ints >> _LIMB_BITS]).astype(np.float64)


def _check_ring(n: int, modulus: int) -> None:
    if n < 4 or n & (n - 1):
        raise InvalidArgumentError(f"ring dimension must be a power of two >= 4, got {n}")
    if not supported(n, modulus):
        raise InvalidArgumentError(
            f"N * q must be below 2^62 (N = {n}, q of {modulus.bit_length()} bits)"
        )


class TernaryProduct:
    """Products ``a * s`` mod ``X^N + 1`` of many polynomials ``a`` by one fixed ternary ``s``.

    The ``a`` have coefficients below q. This is how the key holder computes ``c0 + c1 * s``.

    Parameters
    ----------
    ternary
        The fixed polynomial, shape ``(N,)``, coefficients in {-1, 0, 1}.
    modulus
        The prime q, with ``N * q < 2^62`` (:func:`supported`).
    """

    def __init__(self, ternary: np.ndarray, modulus: int) -> None:
        n = ternary.shape[-1]
        _check_ring(n, modulus)
        if ternary.shape != (n,) or not np.all(np.isin(ternary, (-1, 0, 1))):
            raise InvalidArgumentError("expected one ternary polynomial of shape (N,)")
        self.modulus = modulus
        self._ring = _Negacyclic(n)
        self._spectrum = self._ring.spectrum(ternary.astype(np.float64))

    def times(self, polys: np.ndarray) -> np.ndarray:
        """``a * s`` for ``polys`` of shape ``(B, N)`` in ``[0, q)``.

        Exact int64, not reduced (each coefficient at most ``N * (q - 1) < 2^62`` in magnitude).
        """
        out = np.empty(polys.shape, dtype=np.int64)
        for start in range(0, polys.shape[0], _CHUNK):
            chunk = _limbs(polys[start : start + _CHUNK])
            out[start : start + _CHUNK] = self._ring.combine(
                self._ring.spectrum(chunk) * self._spectrum
            )
        return out


class RingProduct:
    """Products ``a * w mod (X^N + 1, q)`` of many polynomials ``a`` by one fixed ``w``.

    Both have coefficients anywhere in ``[0, q)`` (a threshold key share is uniform modulo
    q, not ternary). Each is split into :data:`_RING_LIMB_BITS`-bit limbs; the limb products
    of each limb degree are summed in the spectrum and come back as exact integers (at most
    ``limbs * N * 2^24``, far inside float64), then are reduced and recombined modulo q.

    Parameters
    ----------
    fixed
        ``w``, shape ``(N,)``, uint64 in ``[0, q)``.
    modulus
        The prime q.
    """

    def __init__(self, fixed: np.ndarray, modulus: int) -> None:
        n = fixed.shape[-1]
        _check_ring(n, modulus)
        if modulus.bit_length() + _RING_LIMB_BITS > 62:  # the Horner step stays in int64
            raise InvalidArgumentError(f"q of {modulus.bit_length()} bits is too large")
        if fixed.shape != (n,) or fixed.dtype != np.uint64 or int(fixed.max()) >= modulus:
            raise InvalidArgumentError("expected one uint64 polynomial of shape (N,) below q")
        self.modulus = modulus
        self._count = -(-modulus.bit_length() // _RING_LIMB_BITS)
        self._ring = _Negacyclic(n)
        self._spectrum = self._ring.spectrum(self._split(fixed))  # (limb, N/2)

    def _split(self, polys: np.ndarray) -> np.ndarray:
        """``(..., N)`` uint64 -> ``(limb, ..., N)`` float64 limbs, lowest first."""
        mask = np.uint64((1 << _RING_LIMB_BITS) - 1)
        return np.stack(
            [(polys >> np.uint64(_RING_LIMB_BITS * k)) & mask for k in range(self._count)]
        ).astype(np.float64)

    def times(self, polys: np.ndarray) -> np.ndarray:
        """``a * w mod q`` for ``polys`` of shape ``(B, N)``, uint64 in ``[0, q)``."""
        q = self.modulus
        out = np.empty(polys.shape, dtype=np.uint64)
        for start in range(0, polys.shape[0], _CHUNK):
            spectrum = self._ring.spectrum(self._split(polys[start : start + _CHUNK]))
            acc = np.zeros((*spectrum.shape[1:-1], self._ring.n), dtype=np.int64)
            for degree in range(2 * self._count - 2, -1, -1):  # Horner in 2^limb_bits
                pairs = [
                    (i, degree - i) for i in range(self._count) if 0 <= degree - i < self._count
                ]
                product = sum(spectrum[i] * self._spectrum[j] for i, j in pairs)
                acc = ((acc << _RING_LIMB_BITS) + self._ring.exact(product) % q) % q
            out[start : start + _CHUNK] = acc.astype(np.uint64)
        return out


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
        if public_key.shape != (2, n):
            raise InvalidArgumentError(f"public key must have shape (2, N), got {public_key.shape}")
        _check_ring(n, modulus)
        if int(public_key.max()) >= modulus:
            raise InvalidArgumentError("public key coefficients must lie below the modulus")
        self.n = n
        self.modulus = modulus
        self._ring = _Negacyclic(n)
        self._key_spectrum = self._ring.spectrum(_limbs(public_key))  # (limb, poly, N/2)

    def products(self, u: np.ndarray) -> np.ndarray:
        """``pk_i * u`` mod ``X^N + 1`` for ternary ``u`` of shape ``(count, N)``, not reduced.

        Returns int64 of shape ``(count, 2, N)``: the exact integer products, each of magnitude
        at most ``N * (q - 1) < 2^62`` (so a small error term can be added before one
        reduction).
        """
        spectrum = self._ring.spectrum(u)  # (count, N/2)
        # (limb, count, poly, N/2): every limb of both key polynomials times u
        return self._ring.combine(self._key_spectrum[:, None, :, :] * spectrum[None, :, None, :])

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
