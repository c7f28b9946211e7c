"""The compressed wire form of a fresh ciphertext: low bits that are only noise, rounded away.

The low bits of a fresh public-key encryption ``(c0, c1)`` are noise, so a client rounds each
coefficient of ``c1`` to a multiple of ``2^d1`` and each coefficient of ``c0`` to a multiple of
``2^d0`` (to nearest, ties to even; Kyber compresses its ciphertexts the same way) and sends
only the multiples. The rounded ciphertext *is* the ciphertext from then on: the client
commits to it, sketches it and hashes its chunk roots over it, and every reader expands the
bytes back to exactly those coefficients. Its decryption carries ``r0 + r1 * s`` more error
(``|r_i| <= 2^(d_i - 1)``), which :class:`crypto.params.CkksParams` bounds
(``value_noise_proxy``) and docs/crypto.md derives.

``c0`` at the :data:`~crypto.params.CANARIES` canary positions is rounded to a multiple of
``2^dc`` only, ``dc <= d0`` (``canary_drop_bits``, 6 at the defaults): a canary's rounding
error raises the bound that the key holder checks canaries against, and with it what a
change that passes them can carry (docs/security.md, claims 19 and 23), so it is kept to at
most 1/64 of a canary's proxy (:data:`~crypto.params.CANARY_ROUNDING_SHARE`). ``r1 * s``
(``d1 = 1``: ``r1`` in {-1, 0, 1}) and that ``rc`` (``|rc| <= 2^(dc - 1)``) reach the
canaries.

Wire format (``d0 + d1 > 0``; without compression a block has only the full form)
------------------------------------------------------------------------------------
Let ``M_d = ceil(q / 2^d)``, ``w_d`` the bits of ``M_d - 1``. Three bit-packed segments
(:mod:`crypto.bitpack`), one after the other:

1. ``c0``, N values of ``w_d0`` bits: the rounded ``c0 / 2^d0`` (``M_d0`` read as 0, since
   ``M_d0 2^d0`` is within ``2^(d0-1)`` of q) but at the canary positions, where it is
   ``v >> (d0 - dc)`` for the canary's rounded ``v = c0 / 2^dc`` (``M_dc`` read as 0);
2. ``c1``, N values of ``w_d1`` bits: the rounded ``c1 / 2^d1`` likewise;
3. the canaries' low bits ``v & (2^(d0 - dc) - 1)``, 32 values of ``d0 - dc`` bits,
   ``4 (d0 - dc)`` bytes: the first half of the bitpack stream of one column of 64 (whose
   values lie one after the other, least significant bit first), the 32 zeros after them
   left out.

A reader refuses any ``v >= M_d`` in the first two segments and any canary
``(high << d0) | (low << dc) >= q``, and expands ``v << d``: every coefficient below q, one
byte string for each ciphertext (the encoding is injective), so two readers of the same
bytes always agree on the coefficients.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crypto import bitpack
from crypto.params import CANARIES, CkksParams
from fedps.errors import InvalidArgumentError

__all__ = ["Compression"]

_COLUMN = 64  # values of one bitpack column; the canaries' low bits fill its first half


class Compression:
    """Compress fresh ciphertexts of one public context into the wire form, and back.

    Parameters
    ----------
    params
        The scheme parameters (``c0_drop_bits``, ``c1_drop_bits``, ``canary_drop_bits``, the
        canary positions).
    modulus
        The coefficient modulus q.
    """

    def __init__(self, params: CkksParams, modulus: int) -> None:
        self.n = params.poly_modulus_degree
        self.modulus = modulus
        #: low bits dropped from c0 (not at its canaries) and from c1
        self.drops: tuple[int, int] = (params.c0_drop_bits, params.c1_drop_bits)
        #: low bits dropped from c0 at its canaries (at most ``drops[0]``)
        self.canary_drop = params.canary_drop_bits
        #: ``M_dc``: a canary's rounded ``c0 / 2^dc`` is below it
        self.canary_limit = _limit(modulus, self.canary_drop)
        #: ``M_d = ceil(q / 2^d)`` per polynomial: compressed values are below it
        self.limits: tuple[int, int] = (
            _limit(modulus, self.drops[0]),
            _limit(modulus, self.drops[1]),
        )
        #: bits per compressed value, per polynomial
        self.widths: tuple[int, int] = (
            (self.limits[0] - 1).bit_length(),
            (self.limits[1] - 1).bit_length(),
        )
        self._canaries = np.array(params.canary_positions, dtype=np.int64)
        self._sizes = (
            bitpack.packed_size(self.n, self.widths[0]),
            bitpack.packed_size(self.n, self.widths[1]),
            CANARIES * self._low_bits // 8,
        )

    @property
    def _low_bits(self) -> int:
        """Bits of each canary's low part in the third segment: ``d0 - dc``."""
        return self.drops[0] - self.canary_drop

    @property
    def enabled(self) -> bool:
        """Whether any bit is dropped (otherwise blocks travel in the full form only)."""
        return any(self.drops)

    @property
    def block_bytes(self) -> int:
        """Exact size of one compressed block."""
        return sum(self._sizes)

    @property
    def canary_bits(self) -> int:
        """Bits one canary position takes in a block: ``c0``'s (both parts) and ``c1``'s."""
        return self.widths[0] + self._low_bits + self.widths[1]

    def compress(self, rows: np.ndarray) -> list[bytes]:
        """Round fresh ciphertexts *in place* to what the wire carries; returns their bytes.

        ``rows`` are ``(B, 2N)`` uint64 coefficients, every value below q.

        After the call ``rows`` holds the canonical expansion of the bytes: what the client
        commits to and what every reader gets back from :meth:`expand`.
        """
        n = self.n
        if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != 2 * n:
            raise InvalidArgumentError(f"compress takes (B, {2 * n}) uint64 coefficients")
        if not len(rows):
            return []
        d0, d1 = self.drops
        dc, low_bits = self.canary_drop, self._low_bits
        canaries = self._round(rows[:, self._canaries], dc, self.canary_limit)  # c0 / 2^dc
        c0 = rows[:, :n]
        c0_high = self._round(c0, d0, self.limits[0])  # (B, N), the canaries re-set below
        c0_high[:, self._canaries] = canaries >> np.uint64(low_bits)
        np.left_shift(c0_high, np.uint64(d0), out=c0)
        c0[:, self._canaries] = canaries << np.uint64(dc)
        c1 = rows[:, n:]
        c1_high = self._round(c1, d1, self.limits[1])
        np.left_shift(c1_high, np.uint64(d1), out=c1)
        low = canaries & np.uint64((1 << low_bits) - 1)
        segments = [
            bitpack.pack_rows(c0_high, self.widths[0]),
            bitpack.pack_rows(c1_high, self.widths[1]),
            _pack_half(low, low_bits),
        ]
        return [b"".join(parts) for parts in zip(*segments, strict=True)]

    @staticmethod
    def _round(poly: np.ndarray, drop: int, limit: int) -> np.ndarray:
        """``poly / 2^drop`` rounded to nearest, ties to even, ``limit`` read as 0."""
        if drop == 0:
            return poly.copy()
        high = poly >> np.uint64(drop)
        rest = poly & np.uint64((1 << drop) - 1)
        half = np.uint64(1 << (drop - 1))
        up = (rest > half) | ((rest == half) & ((high & np.uint64(1)) == np.uint64(1)))
        high += up
        high[high == np.uint64(limit)] = 0
        return high

    def expand(self, data: list[bytes], *, positions: Sequence[int] | None = None) -> np.ndarray:
        """Validate compressed blocks and expand them to their ``(B, 2N)`` coefficients.

        Each block must be exactly :attr:`block_bytes`; every coefficient comes out below q.

        Parameters
        ----------
        data
            The packed blocks.
        positions
            Their places in the caller's list, which error messages name (default: their
            indices in ``data``).

        Raises
        ------
        InvalidArgumentError
            Naming the position of the first block with a wrong length or a value out of
            range.
        """
        n = self.n
        where = list(range(len(data))) if positions is None else list(positions)
        for i, item in enumerate(data):
            if len(item) != self.block_bytes:
                raise InvalidArgumentError(
                    f"ciphertext block #{where[i]} must be exactly {self.block_bytes} bytes "
                    f"(compressed), got {len(item)}"
                )
        out = np.empty((len(data), 2 * n), dtype=np.uint64)
        if not data:
            return out
        a, b, _ = self._sizes
        d0, d1 = self.drops
        c0 = bitpack.unpack_rows([item[:a] for item in data], n, self.widths[0])
        c1 = bitpack.unpack_rows([item[a : a + b] for item in data], n, self.widths[1])
        low = _unpack_half([item[a + b :] for item in data], self._low_bits)
        for poly, limit in ((c0, self.limits[0]), (c1, self.limits[1])):
            bad = np.flatnonzero(poly.max(axis=1) >= np.uint64(limit))
            if bad.size:
                raise InvalidArgumentError(
                    f"ciphertext block #{where[int(bad[0])]}: coefficient out of range "
                    f"(a compressed value not below {limit})"
                )
        np.left_shift(c0, np.uint64(d0), out=out[:, :n])
        np.left_shift(c1, np.uint64(d1), out=out[:, n:])
        out[:, self._canaries] |= low << np.uint64(self.canary_drop)
        bad = np.flatnonzero(out[:, self._canaries].max(axis=1) >= np.uint64(self.modulus))
        if bad.size:
            raise InvalidArgumentError(
                f"ciphertext block #{where[int(bad[0])]}: coefficient out of range (not below q)"
            )
        return out


def _limit(modulus: int, drop: int) -> int:
    """How many multiples of ``2^drop`` lie in ``[0, q)``: ``ceil(q / 2^drop)``."""
    return -(-modulus // (1 << drop))


def _pack_half(values: np.ndarray, bits: int) -> list[bytes]:
    """Pack each row of :data:`~crypto.params.CANARIES` (32) values of ``bits`` bits.

    A row is the first ``4 * bits`` bytes of the bitpack stream of one column of 64 whose
    other values are 0.
    """
    padded = np.zeros((len(values), _COLUMN), dtype=np.uint64)
    padded[:, :CANARIES] = values
    size = CANARIES * bits // 8
    if size == 0:
        return [b""] * len(values)
    return [row[:size] for row in bitpack.pack_rows(padded, bits)]


def _unpack_half(data: list[bytes], bits: int) -> np.ndarray:
    """Inverse of :func:`_pack_half`: ``(B, 32)`` values."""
    if bits == 0:
        return np.zeros((len(data), CANARIES), dtype=np.uint64)
    pad = bytes((_COLUMN - CANARIES) * bits // 8)
    rows = bitpack.unpack_rows([item + pad for item in data], _COLUMN, bits)
    return rows[:, :CANARIES]
