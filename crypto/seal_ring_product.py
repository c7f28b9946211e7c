"""Products ``a * w mod (X^N + 1, q)`` of many polynomials by one fixed ``w``, by SEAL's NTT.

What :class:`crypto.rlwe.RingProduct` computes with numpy's FFT, a key-holder party's partial
decryption ``c1 (lambda_j sh_j)``, exact, about twice as fast at N = 2048: SEAL's NTT modulo
the prime itself needs no limbs, and one SEAL ciphertext carries up to 16 polynomials, every
one of which SEAL's ``multiply_plain`` multiplies by the plaintext. So the polynomials travel
:data:`_PER_CIPHERTEXT` at a time as one ciphertext (written and read with
:mod:`crypto._seal_io`, validated by SEAL's ``load``), are moved into NTT form, multiplied by
``w`` in NTT form (a plaintext of scale 1), and moved back.

The last polynomial of each such ciphertext is the constant 1, whose product must come back
as ``w`` itself: it keeps the ciphertext from being "transparent" (every polynomial after the
first zero, which SEAL refuses to multiply), and it checks every batch.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import tenseal.sealapi as seal

from crypto import _seal_io
from crypto.public_context import PublicContext
from fedps.errors import InvalidArgumentError

__all__ = ["SealRingProduct"]

#: Polynomials per ciphertext: SEAL's largest ciphertext (16) less the constant 1.
_PER_CIPHERTEXT = 15
# Offsets in a serialised ciphertext's body (the layout of crypto.public_context's prefix):
_SIZE = 33  # how many polynomials, after parms_id and is_ntt_form
_ARRAY_BYTES = 81  # the size field of the data array's own header
_ARRAY_COUNT = 89  # how many coefficients the data array holds
_PLAIN_SCALE = 40  # a plaintext's scale, after parms_id and its coefficient count


class SealRingProduct:
    """``a * w mod (X^N + 1, q)`` for many ``a`` and one fixed ``w``, through SEAL.

    Parameters
    ----------
    public
        The context whose parameters (N, the one prime q) the polynomials have.
    fixed
        ``w``, shape ``(N,)``, uint64 in ``[0, q)``.
    """

    def __init__(self, public: PublicContext, fixed: np.ndarray) -> None:
        n, q = public.params.poly_modulus_degree, public.modulus
        if fixed.shape != (n,) or fixed.dtype != np.uint64 or int(fixed.max()) >= q:
            raise InvalidArgumentError("expected one uint64 polynomial of shape (N,) below q")
        self.modulus = q
        self._n = n
        self._public = public
        self._context = public.seal_context
        self._evaluator = seal.Evaluator(self._context)
        self._fixed = fixed
        self._one = np.zeros((1, n), dtype=np.uint64)
        self._one[0, 0] = 1
        # a zero factor has no NTT form SEAL computes (its ciphertext is "transparent")
        self._plain = self._ntt_plaintext(self._ntt(fixed)) if fixed.any() else None

    def times(self, polys: np.ndarray) -> np.ndarray:
        """``a * w mod q`` for ``polys`` of shape ``(B, N)``, uint64 in ``[0, q)``.

        Raises
        ------
        InvalidArgumentError
            ``polys`` is not ``(B, N)`` uint64 below q.
        ArithmeticError
            SEAL's product of the constant 1 is not ``w`` (never expected).
        """
        q = self.modulus
        if polys.dtype != np.uint64 or polys.ndim != 2 or polys.shape[1] != self._n:
            raise InvalidArgumentError(f"expected (B, {self._n}) uint64 coefficients")
        if polys.size and int(polys.max()) >= q:
            raise InvalidArgumentError("a coefficient is not below the modulus")
        out = np.zeros(polys.shape, dtype=np.uint64)
        if self._plain is None:
            return out
        for start in range(0, len(polys), _PER_CIPHERTEXT):
            batch = np.concatenate([polys[start : start + _PER_CIPHERTEXT], self._one])
            cipher = self._load(batch)
            self._evaluator.transform_to_ntt_inplace(cipher)
            self._evaluator.multiply_plain_inplace(cipher, self._plain)
            self._evaluator.transform_from_ntt_inplace(cipher)
            product = self._polys(cipher, len(batch))
            if not np.array_equal(product[-1], self._fixed):
                raise ArithmeticError("SEAL's product of the constant 1 is not the fixed factor")
            out[start : start + _PER_CIPHERTEXT] = product[:-1]
        return out

    def _ntt(self, poly: np.ndarray) -> np.ndarray:
        """``poly`` in SEAL's NTT form (of the ciphertext ``(poly, poly)``)."""
        cipher = self._load(np.stack([poly, poly]))
        self._evaluator.transform_to_ntt_inplace(cipher)
        ntt: np.ndarray = self._polys(cipher, 2)[0]
        return ntt

    def _ntt_plaintext(self, ntt: np.ndarray) -> Any:
        """A SEAL plaintext in NTT form holding ``ntt``, of scale 1.

        Its metadata come from a plaintext SEAL's CKKS encoder made for this context.
        """
        template = seal.Plaintext()
        seal.CKKSEncoder(self._context).encode(1.0, 2.0, template)
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(template))
        prefix = bytearray(body[: len(body) - 8 * self._n])
        struct.pack_into("<d", prefix, _PLAIN_SCALE, 1.0)
        plain = seal.Plaintext()
        data = _seal_io.with_header(bytes(prefix) + ntt.astype("<u8").tobytes())
        _seal_io.load_into(plain, self._context, data)
        if not plain.is_ntt_form():
            raise InvalidArgumentError("unexpected SEAL plaintext layout")
        return plain

    def _load(self, polys: np.ndarray) -> Any:
        """One coefficient-form SEAL ciphertext of the (2 to 16) polynomials ``polys``."""
        prefix = bytearray(self._public.ciphertext_prefix)
        size, count = len(polys), polys.size
        if struct.unpack_from("<Q", prefix, _SIZE) != (2,) or struct.unpack_from(
            "<Q", prefix, _ARRAY_COUNT
        ) != (2 * self._n,):
            raise InvalidArgumentError("unexpected SEAL ciphertext layout")
        struct.pack_into("<Q", prefix, _SIZE, size)
        struct.pack_into("<Q", prefix, _ARRAY_BYTES, _seal_io.HEADER_SIZE + 8 + 8 * count)
        struct.pack_into("<Q", prefix, _ARRAY_COUNT, count)
        cipher = seal.Ciphertext()
        data = _seal_io.with_header(bytes(prefix) + polys.astype("<u8").tobytes())
        _seal_io.load_into(cipher, self._context, data)
        return cipher

    def _polys(self, cipher: Any, size: int) -> np.ndarray:
        """The ``size`` polynomials of ``cipher``, ``(size, N)`` uint64."""
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(cipher))
        offset = len(body) - 8 * size * self._n
        polys = np.frombuffer(body, dtype="<u8", offset=offset).astype(np.uint64)
        out: np.ndarray = polys.reshape(size, self._n)
        return out
