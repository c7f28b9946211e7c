"""CKKS encoding in numpy, batched over blocks: real values -> plaintext coefficients mod q.

CKKS (Cheon, Kim, Kim, Song 2017) encodes N/2 complex slots ``z`` into an integer polynomial
``m`` of degree < N with ``m(zeta^(3^j)) ~= scale * z_j``, zeta = exp(i*pi/N) a primitive
2N-th root of unity, and ``m(conj) = conj(m)`` so that ``m`` is real. Evaluating ``m`` at every
odd power ``zeta^(2l+1)`` is one length-N FFT of ``m_t * zeta^t``, so encoding is the inverse:
place ``scale * z_j`` at ``l = (3^j mod 2N - 1) / 2`` and its conjugate at the mirrored odd
power, take one FFT, untwist by ``zeta^-t`` and round. This is the slot order SEAL's
``CKKSEncoder`` uses (tests check against SEAL's decoder), done for many blocks at once in
float64 with no Python lists.

fedps packs two reals per slot: block values ``0..N/2-1`` are the real parts and
``N/2..N-1`` the imaginary parts.
"""

from __future__ import annotations

import numpy as np

from fedps.errors import InvalidArgumentError

__all__ = ["CkksEncoder"]

# float64 represents integers exactly below 2**53; keep encoded coefficients well inside.
_MAX_COEFF_BITS = 52


class CkksEncoder:
    """Batched CKKS encoder/decoder for ring dimension ``n`` and a given scale.

    Parameters
    ----------
    n
        Ring dimension N (a power of two); a block holds N real values.
    scale
        The encoding scale (2**scale_bits).
    modulus
        The coefficient modulus q; :meth:`encode` returns coefficients in [0, q).
    """

    def __init__(self, n: int, scale: float, modulus: int) -> None:
        if n < 2 or n & (n - 1):
            raise InvalidArgumentError(f"ring dimension must be a power of two, got {n}")
        self.n = n
        self.scale = scale
        self.modulus = modulus
        half = n // 2
        powers = np.empty(half, dtype=np.int64)
        k = 1
        for j in range(half):
            powers[j] = k
            k = (k * 3) % (2 * n)
        self._slot_pos = (powers - 1) // 2  # odd power 2l+1 = 3^j (SEAL uses generator 3)
        self._conj_pos = (2 * n - powers - 1) // 2  # its conjugate, -3^j mod 2N
        t = np.arange(n)
        self._twist = np.exp(1j * np.pi * t / n)  # zeta^t, for decode
        # Half-length encoding: slot j lands at l with 4l+1 = +-3^j (mod 2N).
        positive = powers % 4 == 1
        target = np.where(positive, (powers - 1) // 4, (2 * n - powers - 1) // 4)
        self._gather = np.empty(half, dtype=np.int64)
        self._gather[target] = np.arange(half)
        self._conj_sign = np.where(positive, 1.0, -1.0)[self._gather]
        self._half_untwist = np.exp(-1j * np.pi * np.arange(half) / n)  # zeta^-t, t < N/2

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Encode a (B, N) float array into (B, N) uint64 coefficients modulo q.

        Uses the half-length transform for real negacyclic polynomials: with
        ``psi_l = zeta^(4l+1)`` and ``M = N/2``, ``m(psi_l) = sum_t a_t e^(2 pi i l t / M)`` where
        ``a_t = (m_t + i m_(t+M)) zeta^t``. Each slot's power ``3^j`` is either some ``4l+1``
        (the slot value goes to ``l``) or its negative (the conjugate goes to ``l``), so one
        length-M FFT of the gathered slots gives ``a``, and untwisting gives ``m``.

        Raises
        ------
        InvalidArgumentError
            If the shape is wrong, a value is not finite, or a scaled value is too large
            to encode exactly.
        """
        if values.ndim != 2 or values.shape[1] != self.n:
            raise InvalidArgumentError(f"expected shape (B, {self.n}), got {values.shape}")
        if not np.all(np.isfinite(values)):
            raise InvalidArgumentError("cannot encode NaN or infinite values")
        half = self.n // 2
        limit = 2.0**_MAX_COEFF_BITS / self.scale / self.n
        if values.size and float(np.abs(values).max()) > limit:
            raise InvalidArgumentError(f"values must be below {limit:g} in magnitude to encode")
        spectrum = np.empty((values.shape[0], half), dtype=np.complex128)
        spectrum.real = values[:, self._gather]
        spectrum.imag = values[:, half + self._gather]
        spectrum.imag *= self._conj_sign
        spectrum *= self.scale / half
        folded = np.fft.fft(spectrum, axis=1)
        folded *= self._half_untwist
        out = np.empty((values.shape[0], self.n), dtype=np.int64)
        np.rint(folded.real, out=folded.real)
        np.rint(folded.imag, out=folded.imag)
        out[:, :half] = folded.real
        out[:, half:] = folded.imag
        out[out < 0] += self.modulus
        return out.view(np.uint64)

    def decode(self, coeffs: np.ndarray) -> np.ndarray:
        """Decode (B, N) coefficients modulo q (centred) back to (B, N) real values."""
        if coeffs.ndim != 2 or coeffs.shape[1] != self.n:
            raise InvalidArgumentError(f"expected shape (B, {self.n}), got {coeffs.shape}")
        q = self.modulus
        centred = np.where(
            coeffs > q // 2, coeffs.astype(np.float64) - q, coeffs.astype(np.float64)
        )
        evaluations = np.fft.ifft(centred * self._twist, axis=1) * self.n
        slots = evaluations[:, self._slot_pos] / self.scale
        return np.concatenate([slots.real, slots.imag], axis=1)
