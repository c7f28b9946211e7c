"""Blinding pads: a client's ciphertext decrypts to nothing outside the committed sum.

The key holder checks an aggregate against the sketches its contributors committed to
(:mod:`crypto.sketch`) under a challenge that every cohort member knows, since each sketches
its own blocks with it. A shard that has one cohort client with it therefore knows the
challenge too, and can hand over ``c_victim + c_colluder + Y`` with a small ``Y`` whose sketch
is the omitted clients' sketches: every check passes, and the colluder reads the victim's
update off the released "sum".

A pad closes that. For each round the key holder derives a secret seed per cohort member
(:meth:`server.keyholder.commit_board.CommitBoard.pad_seed`) and hands it only to that member
(with the round's challenge, over the member's authenticated channel). The member adds the
pad, uniform modulo q on every value coefficient of ``c0``, to each block before it rounds,
commits and sketches it: what travels, is committed and is summed is the padded ciphertext.
The key holder subtracts ``sum m_i pad_i`` of the contributors it was asked to decrypt (with
their multipliers ``m_i``) before it decrypts. The pads cancel exactly when the aggregate holds
each contributor's ciphertext exactly ``m_i`` times; any other combination leaves a sum of pads
that nobody outside the key holder and the omitted clients knows, uniform modulo q on every
value coefficient, which makes the decryption uniform there: the sum cannot be read, and the
bound or grid check refuses it.

The canary coefficients carry no pad: the key holder checks them and opens them one client at a
time to trace a change in ``c1`` (:mod:`crypto.canary`), and they carry no value.

The pads of seed ``k`` are read off one AES-256-CTR keystream under ``k`` (counter from 0), as
64-bit little-endian words cut to ``bit_length(q)`` bits: block ``b`` takes words ``b V`` to
``(b + 1) V - 1`` (``V`` value coefficients a block), in order, and each word that is not below
q (rejection sampling: what is kept is exactly uniform; at the default 46-bit q, one word in
6 x 10^8) is replaced by the next words below q of the block's own second stream, the
keystream from the counter block ``2^127 + b 2^64``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from crypto.params import CkksParams
from fedps.errors import InvalidArgumentError

__all__ = ["PAD_SEED_BYTES", "Blinding"]

#: Bytes of a pad seed (an AES-256 key).
PAD_SEED_BYTES = 32


class Blinding:
    """The pads of one set of CKKS parameters and modulus.

    Parameters
    ----------
    params
        The CKKS parameters (which coefficients carry values).
    modulus
        The ciphertext modulus q (prime, below 2^62).
    """

    def __init__(self, params: CkksParams, modulus: int) -> None:
        if not 2 <= modulus < 1 << 62:
            raise InvalidArgumentError("blinding needs a modulus below 2^62")
        self.n = params.poly_modulus_degree
        self.modulus = modulus
        self._q = np.uint64(modulus)
        self._low_bits = np.uint64((1 << modulus.bit_length()) - 1)
        self._values = np.array(params.value_positions, dtype=np.int64)

    def pads(self, seed: bytes, blocks: Sequence[int]) -> np.ndarray:
        """The pads of ``blocks`` under ``seed``: uint64, shape (len(blocks), V), below q."""
        if len(seed) != PAD_SEED_BYTES:
            raise InvalidArgumentError(f"a pad seed is {PAD_SEED_BYTES} bytes, got {len(seed)}")
        wanted = np.asarray(blocks, dtype=np.int64)
        v = len(self._values)
        if not wanted.size:
            return np.empty((0, v), dtype=np.uint64)
        if int(wanted.min()) < 0:
            raise InvalidArgumentError("block indices are not negative")
        first, last = int(wanted.min()), int(wanted.max())
        # the words of blocks first..last, in one pass of the keystream
        start, skip = divmod(first * v, 2)  # 2 words per 16-byte counter block
        words = _keystream(seed, start, skip + (last - first + 1) * v)[skip:]
        out = (words.reshape(last - first + 1, v) & self._low_bits)[wanted - first]
        for i in np.flatnonzero((out >= self._q).any(axis=1)):
            out[i] = self._refill(seed, int(wanted[i]), out[i])
        return out

    def _refill(self, seed: bytes, block: int, row: np.ndarray) -> np.ndarray:
        """``row`` with each word not below q replaced, in order, from the block's 2nd stream."""
        bad = row >= self._q
        missing = int(bad.sum())
        count = 2 * missing + 16
        while True:  # a longer stream has the same start: the same words taken
            extra = _keystream(seed, (1 << 127) | (block << 64), count) & self._low_bits
            extra = extra[extra < self._q]
            if len(extra) >= missing:
                row[bad] = extra[:missing]
                return row
            count *= 2

    def add(self, c0: np.ndarray, seed: bytes, blocks: Sequence[int]) -> None:
        """Add the pads of ``blocks`` to their first polynomials ``c0`` (rows), in place.

        ``c0`` is uint64 of shape (len(blocks), N), every value below q.
        """
        self._check_rows(c0, blocks)
        values = c0[:, self._values] + self.pads(seed, blocks)  # each term < q < 2^62
        c0[:, self._values] = np.where(values >= self._q, values - self._q, values)

    def remove(
        self, rows: np.ndarray, blocks: Sequence[int], seeds: Iterable[tuple[bytes, int]]
    ) -> np.ndarray:
        """``rows`` (whole ciphertexts, (len(blocks), 2N)) less ``sum m * pad`` of ``seeds``.

        ``seeds`` holds each contributor's pad seed with its integer multiplier ``m``: what the
        aggregate must hold of that contributor. Returns a new array.
        """
        self._check_rows(rows[:, : self.n], blocks)
        q = self.modulus
        total = np.zeros((len(blocks), len(self._values)), dtype=np.uint64)
        reach = 0  # a bound on every entry of total, kept below 2^63 by reducing
        for seed, multiplier in seeds:
            m = int(multiplier) % q
            if m * q >= 1 << 62:  # a large multiplier (none of fedps's): reduce as we go
                term = _mul_mod(self.pads(seed, blocks), m, q)
                weight = q
            else:
                term = self.pads(seed, blocks)
                term *= np.uint64(m)
                weight = m * q
            if reach + weight >= 1 << 63:
                total %= self._q
                reach = q
            total += term
            reach += weight
        total %= self._q
        out = rows.copy()
        c0 = out[:, : self.n]
        values = c0[:, self._values] + (self._q - total)  # q - total in (0, q]
        values = np.where(values >= self._q, values - self._q, values)
        c0[:, self._values] = values
        return out

    def _check_rows(self, c0: np.ndarray, blocks: Sequence[int]) -> None:
        if c0.dtype != np.uint64 or c0.shape != (len(blocks), self.n):
            raise InvalidArgumentError(
                f"pads apply to uint64 rows of {self.n} coefficients, one per block"
            )


def _keystream(seed: bytes, counter: int, words: int) -> np.ndarray:
    """``words`` 64-bit words of AES-256-CTR under ``seed`` from the 128-bit ``counter``."""
    stream = Cipher(algorithms.AES(seed), modes.CTR(counter.to_bytes(16, "big"))).encryptor()
    return np.frombuffer(stream.update(bytes(8 * words)), dtype=np.uint64)


def _mul_mod(values: np.ndarray, m: int, q: int) -> np.ndarray:
    """``values * m mod q`` exactly, for ``values`` below q < 2^62 and ``0 <= m < q``.

    Double and add: every intermediate stays below ``2q < 2^63``, and the multipliers are
    small (staleness multipliers have :data:`crypto.params.ASYNC_WEIGHT_BITS` bits).
    """
    result = np.zeros_like(values)
    base = values.copy()
    qq = np.uint64(q)
    while m:
        if m & 1:
            result += base
            np.subtract(result, qq, out=result, where=result >= qq)
        m >>= 1
        if m:
            base += base
            np.subtract(base, qq, out=base, where=base >= qq)
    return result
