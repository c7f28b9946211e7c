"""Shard side: validate packed ciphertext blocks and add them modulo q.

A shard never holds a secret key and never builds SEAL objects from network bytes: a packed
block is checked for its exact length, unpacked to 2N integers, checked coefficient by
coefficient (every value below q), and only then added into the running sum. The sum's
memory is one block whatever the number of contributors.

A block travels in one of two forms, told apart by their exact lengths
(:attr:`crypto.public_context.PublicContext.block_sizes`): the compressed form of a fresh
ciphertext, as clients send it (:mod:`crypto.compression`), and the full form, ``ceil(log2
q)`` bits per coefficient, as any ciphertext can travel (a sum: a shard's aggregate). Every
reader accepts both, validates either exactly and works on the coefficients they expand to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crypto import bitpack
from crypto.plain_context import PlainContext
from crypto.public_context import PublicContext
from fedps.errors import InvalidArgumentError

__all__ = ["CiphertextSum", "PlainSum", "new_sum", "pack_sums", "unpack_block", "unpack_blocks"]


def unpack_block(public: PublicContext, data: bytes) -> np.ndarray:
    """Validate one packed block and return its 2N coefficients (uint64).

    Raises
    ------
    InvalidArgumentError
        If the length is not exactly one block (either form) or a coefficient is out of
        range.
    """
    coeffs: np.ndarray = unpack_blocks(public, [data])[0]
    return coeffs


def unpack_blocks(public: PublicContext | PlainContext, data: list[bytes]) -> np.ndarray:
    """Validate several packed blocks at once; returns their coefficients, shape (B, 2N).

    Each block may be in the full or the compressed form.

    Raises
    ------
    InvalidArgumentError
        Naming the position of the first block with a wrong length or a coefficient out of
        range.
    """
    if isinstance(public, PlainContext):
        return public.unpack_blocks(data)
    full, compression = public.full_block_bytes, public.compression
    sizes = sorted(public.block_sizes)
    for i, item in enumerate(data):
        if len(item) not in sizes:
            raise InvalidArgumentError(
                f"ciphertext block #{i} must be exactly "
                f"{' or '.join(map(str, sizes))} bytes, got {len(item)}"
            )
    whole = [i for i, item in enumerate(data) if len(item) == full]
    if len(whole) == len(data):  # aggregates; every block without compression
        return _unpack_full(public, data, whole)
    if not whole:  # a client's push
        return compression.expand(data)
    coeffs = np.empty((len(data), public.coeffs_per_block), dtype=np.uint64)
    compressed = [i for i, item in enumerate(data) if len(item) != full]
    coeffs[compressed] = compression.expand([data[i] for i in compressed], positions=compressed)
    if whole:
        coeffs[whole] = _unpack_full(public, [data[i] for i in whole], whole)
    return coeffs


def _unpack_full(public: PublicContext, data: list[bytes], positions: list[int]) -> np.ndarray:
    """Full-form blocks (lengths checked), every coefficient checked below q.

    ``positions`` are their places in the caller's list, for the error message.
    """
    coeffs = bitpack.unpack_rows(data, public.coeffs_per_block, public.coeff_bits)
    if len(data):
        bad = np.flatnonzero(coeffs.max(axis=1) >= np.uint64(public.modulus))
        if bad.size:
            raise InvalidArgumentError(
                f"ciphertext block #{positions[int(bad[0])]}: coefficient out of range "
                "(not below q)"
            )
    return coeffs


class CiphertextSum:
    """Running sum of validated ciphertext blocks for one parameter block."""

    def __init__(self, public: PublicContext, coeffs: np.ndarray | None = None) -> None:
        self._q = np.uint64(public.modulus)
        self._public = public
        self._acc = np.zeros(public.coeffs_per_block, dtype=np.uint64) if coeffs is None else coeffs

    def add(self, coeffs: np.ndarray, multiplier: int = 1) -> None:
        """Add already-validated coefficients (times a small integer constant) modulo q."""
        if multiplier != 1:
            limit = 1 << (64 - self._public.coeff_bits)
            if not 0 < multiplier < limit:
                raise InvalidArgumentError(f"multiplier must be in (0, {limit})")
            # c < q < 2**bits and m < 2**(64 - bits): the product fits in 64 bits.
            coeffs = (coeffs * np.uint64(multiplier)) % self._q
        acc = self._acc
        np.add(acc, coeffs, out=acc)  # below 2q < 2**64
        # acc - q wraps around (past every value below 2q) exactly where acc < q: the smaller of
        # the two is acc mod q, without a masked subtraction
        np.minimum(acc, acc - self._q, out=acc)

    def add_packed(self, data: bytes) -> None:
        """Validate a packed block and add it."""
        self.add(unpack_block(self._public, data))

    @property
    def coefficients(self) -> np.ndarray:
        """The current sum's coefficients (a copy)."""
        return self._acc.copy()

    def packed(self) -> bytes:
        """The current sum as a packed block in the full form.

        A sum is no longer on the grid of the compressed form.
        """
        return bitpack.pack(self._acc, self._public.coeff_bits)


class PlainSum:
    """Running sum of plaintext blocks (encryption switched off; insecure baseline)."""

    def __init__(self, context: PlainContext) -> None:
        self._acc = np.zeros(context.values_per_block, dtype=np.float64)

    def add(self, values: np.ndarray, multiplier: int = 1) -> None:
        """Add validated values (times a small integer constant)."""
        self._acc += values * multiplier

    @property
    def coefficients(self) -> np.ndarray:
        """The current sum (a copy)."""
        return self._acc.copy()

    def packed(self) -> bytes:
        """The sum as float64 bytes."""
        return self._acc.astype("<f8").tobytes()


def pack_sums(sums: Sequence[CiphertextSum | PlainSum]) -> list[bytes]:
    """What :meth:`CiphertextSum.packed` gives for each of ``sums``, in one vectorised pass.

    Ciphertext sums of one coefficient width are packed together
    (:func:`crypto.bitpack.pack_rows`, the same bytes as one at a time); anything else one by
    one.

    Parameters
    ----------
    sums
        Running sums, of ciphertexts or of plaintext values.

    Returns
    -------
    list of bytes
        Each sum's packed form, in order.
    """
    widths = {s._public.coeff_bits for s in sums if isinstance(s, CiphertextSum)}
    if len(widths) != 1 or not all(isinstance(s, CiphertextSum) for s in sums):
        return [s.packed() for s in sums]
    rows = np.stack([s._acc for s in sums if isinstance(s, CiphertextSum)])
    return bitpack.pack_rows(rows, widths.pop())


def new_sum(context: PublicContext | PlainContext) -> CiphertextSum | PlainSum:
    """An empty running sum for blocks of ``context``."""
    if isinstance(context, PlainContext):
        return PlainSum(context)
    return CiphertextSum(context)
