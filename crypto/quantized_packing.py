"""Quantized packing: several low-precision values to one plaintext coefficient.

A client clips each value of its (already noised) update to the public range
``[-R, R]`` (``he.max_abs_value``, the range plain packing is sized for), quantizes it with
stochastic rounding to an integer ``u`` in ``[0, 2^B - 1]`` (unbiased: ``E[u] = (x + R) / step``
with ``step = 2R / (2^B - 1)``), and packs ``K`` of them into one coefficient as the integer
``sum_k u_k 2^(k w)`` at scale ``2^g``: each field has ``w = B + ceil(log2(max_clients))`` bits,
so the sum of ``max_clients`` contributions never carries into the next field, and ``g`` guard
bits below the lowest field absorb the decryption error (:func:`crypto.params.packing_params`
derives ``K``, ``g`` and the modulus; docs/crypto.md, *Quantized packing*).

Within a block of ``K x V`` values (``V`` values per ciphertext), coefficient ``j`` holds values
``j, V + j, ..., (K - 1) V + j``; the last block is padded with zeros, which decode to padding
the key holder drops. Shards add ciphertexts unchanged. The key holder rounds each decrypted sum
to the nearest integer (refusing a sum whose distance to it exceeds the proven decryption
error: nothing of the error is then released, :meth:`QuantizedPacking.unpack`), splits the
fields with integer arithmetic, refuses a field above ``n (2^B - 1)`` (an overflow: ``n``
contributions cannot reach it), and dequantizes: ``sum x = step x sum u - n R``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from crypto.params import CkksParams, packing_params
from fedps.errors import ConfigError, InvalidArgumentError

__all__ = ["OffGridError", "QuantizedPacking"]


class OffGridError(InvalidArgumentError):
    """A decrypted sum farther from an integer than the decryption error allows.

    Unlike an overflow, whether a sum is refused this way depends on the decryption error, so on
    the secret key: a client can aim a change below the canaries' bound and an offset of its own
    plaintext so that the refusal tells one coefficient of ``s`` (docs/crypto.md, *Quantized
    packing*).
    """


@dataclass(frozen=True)
class QuantizedPacking:
    """``bits``-bit values, ``fields`` to a coefficient, for sums of up to ``max_clients``.

    Build one with :meth:`derive`.

    Parameters
    ----------
    bits
        Bits of one quantized value (B).
    max_clients
        Most contributions one sum adds.
    max_abs_value
        The public range R: values are clipped to ``[-R, R]`` before quantization.
    fields
        Quantized values per coefficient (K).
    params
        The CKKS parameters (``scale_bits`` is the guard ``g``).
    """

    bits: int
    max_clients: int
    max_abs_value: float
    fields: int
    params: CkksParams

    @classmethod
    def derive(
        cls, *, bits: int, max_clients: int, max_abs_value: float, plain: CkksParams
    ) -> QuantizedPacking:
        """The packing of ``bits``-bit values (:func:`crypto.params.packing_params`).

        Parameters
        ----------
        bits
            Bits of one quantized value, 1 to 16.
        max_clients
            Most contributions one sum adds.
        max_abs_value
            The public range R.
        plain
            The parameters of plain packing (one real value per coefficient) for the same
            workload: the packing must send fewer bytes per value than they do.

        Returns
        -------
        QuantizedPacking
            The packing, with the most fields per coefficient its cheapest parameters allow.

        Raises
        ------
        ConfigError
            No field fits a coefficient, or the packing does not send fewer bytes per value
            than plain packing.
        """
        if not 1 <= bits <= 16:
            raise ConfigError(f"quantized values have 1 to 16 bits, got {bits}")
        field_bits = bits + math.ceil(math.log2(max_clients))
        params, fields = packing_params(field_bits, max_clients)
        packing = cls(bits, max_clients, max_abs_value, fields, params)
        plain_bytes = plain.wire_bits / 8 / plain.values_per_block
        if packing.bytes_per_value >= plain_bytes:
            raise ConfigError(
                f"{bits}-bit values packed {fields} to a coefficient cost "
                f"{packing.bytes_per_value:.2f} bytes each, plain packing "
                f"{plain_bytes:.2f}: quantizing saves nothing"
            )
        return packing

    @property
    def field_bits(self) -> int:
        """Bits of one field: B + ceil(log2(max_clients))."""
        return self.bits + math.ceil(math.log2(self.max_clients))

    @property
    def levels(self) -> int:
        """The largest quantized value, ``2^B - 1``."""
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        """The quantization step, ``2 R / (2^B - 1)``."""
        return 2.0 * self.max_abs_value / self.levels

    @property
    def values_per_block(self) -> int:
        """Quantized values per ciphertext: ``K`` per value coefficient."""
        return self.fields * self.params.values_per_block

    @property
    def bytes_per_value(self) -> float:
        """Bytes sent per quantized value (a full block, canaries counted)."""
        return self.params.wire_bits / 8 / self.values_per_block

    def quantize(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``values`` clipped to ``[-R, R]`` and rounded stochastically to ``[0, 2^B - 1]``.

        ``floor(y)`` or ``floor(y) + 1`` for ``y = (x + R) / step``, the latter with
        probability ``y - floor(y)``: unbiased, with variance at most ``step^2 / 4`` per value.

        Parameters
        ----------
        values
            A float vector.
        rng
            Where the rounding draws come from.

        Returns
        -------
        np.ndarray
            int64 integers in ``[0, 2^B - 1]``.
        """
        r = self.max_abs_value
        scaled = (np.clip(np.asarray(values, dtype=np.float64), -r, r) + r) / self.step
        low = np.floor(scaled)
        up = rng.random(scaled.shape) < scaled - low
        out: np.ndarray = np.clip(low + up, 0, self.levels).astype(np.int64)
        return out

    def dequantize(self, sums: np.ndarray, contributors: int) -> np.ndarray:
        """Sums of ``contributors`` quantized values, back to sums of values.

        Parameters
        ----------
        sums
            Integer sums of quantized values.
        contributors
            How many values each sum adds (n).

        Returns
        -------
        np.ndarray
            ``step x sums - n R`` (float64).
        """
        out: np.ndarray = sums * self.step - contributors * self.max_abs_value
        return out

    def pack(self, quantized: np.ndarray) -> np.ndarray:
        """Quantized values packed ``K`` to a coefficient, as the values plain encoding takes.

        Parameters
        ----------
        quantized
            Integers in ``[0, 2^B - 1]`` (:meth:`quantize`).

        Returns
        -------
        np.ndarray
            ``blocks x V`` float64 values ``sum_k u_k 2^(k w)`` (exact: below 2^53), to encode
            at scale ``2^g``, ``blocks = ceil(len / (K V))``.

        Raises
        ------
        InvalidArgumentError
            A value outside ``[0, 2^B - 1]``.
        """
        if quantized.size and (quantized.min() < 0 or quantized.max() > self.levels):
            raise InvalidArgumentError(f"quantized values must be in [0, {self.levels}]")
        per_block = self.values_per_block
        blocks = -(-quantized.size // per_block)
        padded = np.zeros(blocks * per_block, dtype=np.int64)
        padded[: quantized.size] = quantized
        split = padded.reshape(blocks, self.fields, self.params.values_per_block)
        packed = (split << self._shifts[None, :, None]).sum(axis=1)
        out: np.ndarray = packed.reshape(-1).astype(np.float64)
        return out

    def unpack(self, rows: np.ndarray, *, contributors: int, noise_weight: float) -> np.ndarray:
        """Decrypted sums of packed coefficients, split into their fields' integer sums.

        Each row is a block's ``V`` decrypted values (in units of the lowest field). Each is
        rounded to the nearest integer, which is the exact sum when the decryption error stays
        within its proven bound (:meth:`crypto.params.CkksParams.error_bound`, below half a
        unit by the derivation): a value farther from every integer is refused, so what is
        released is a function of the plaintext sums alone, never of the decryption error.

        Parameters
        ----------
        rows
            ``(blocks, V)`` decrypted values, sums of ``contributors`` ciphertexts.
        contributors
            How many quantized values each field sums (n).
        noise_weight
            ``sum m_i^2`` of the sum's integer weights (the contributors, in sync rounds).

        Returns
        -------
        np.ndarray
            ``(blocks, K V)`` int64 sums of quantized values.

        Raises
        ------
        OffGridError
            A value farther from an integer than the decryption error allows.
        InvalidArgumentError
            An overflow: a negative sum, or a field above ``n (2^B - 1)``.
        """
        if not 1 <= contributors <= self.max_clients:
            raise InvalidArgumentError(
                f"a packed sum adds 1 to {self.max_clients} contributions, got {contributors}"
            )
        nearest = np.rint(rows)
        bound = self.params.error_bound(noise_weight)
        if rows.size and float(np.abs(rows - nearest).max()) > bound:
            raise OffGridError(
                "a decrypted packed sum is farther from an integer than the decryption error "
                "allows (a value off the grid, or a change to the ciphertext)"
            )
        top = contributors * self.levels
        if rows.size and (
            nearest.min() < 0 or nearest.max() >= 2.0 ** (self.fields * self.field_bits)
        ):
            raise InvalidArgumentError("a packed sum is out of range: its fields overflowed")
        packed = nearest.astype(np.int64)
        mask = (1 << self.field_bits) - 1
        split = (packed[:, None, :] >> self._shifts[None, :, None]) & mask
        if split.size and int(split.max()) > top:
            raise InvalidArgumentError(
                f"a field sums to more than {contributors} values of {self.bits} bits can: "
                "it overflowed"
            )
        out: np.ndarray = split.reshape(rows.shape[0], self.values_per_block)
        return out

    @property
    def _shifts(self) -> np.ndarray:
        """Each field's offset in bits: ``k w``."""
        return np.arange(self.fields, dtype=np.int64) * self.field_bits
