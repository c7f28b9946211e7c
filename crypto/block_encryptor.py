"""Client side: encrypt a flat update vector into packed ciphertext blocks.

A vector of P values is cut into ``ceil(P / N)`` blocks of N values (the last one padded with
zeros). Block ``b`` packs values ``b*N .. b*N + N/2`` into the real parts of the N/2 complex
slots and the next N/2 into the imaginary parts, is encrypted under the public key, and leaves
as its 2N raw coefficients bit-packed to ``ceil(log2 q)`` bits (``crypto.bitpack``). The shard
adds such blocks as integer arrays modulo q without ever building a SEAL object.
"""

from __future__ import annotations

import numpy as np
import tenseal.sealapi as seal

from crypto import bitpack
from crypto.public_context import PublicContext
from fedps.errors import InvalidArgumentError

__all__ = ["BlockEncryptor", "num_blocks"]


def num_blocks(num_values: int, values_per_block: int) -> int:
    """Blocks needed for ``num_values`` values."""
    return max(1, -(-num_values // values_per_block))


class BlockEncryptor:
    """Encrypts blocks of real values under a :class:`PublicContext`."""

    def __init__(self, public: PublicContext) -> None:
        self.public = public
        self._encoder = seal.CKKSEncoder(public.seal_context)
        self._encryptor = seal.Encryptor(public.seal_context, public.public_key)

    def encrypt_block(self, values: np.ndarray) -> bytes:
        """Encrypt exactly N real values (float64) into one packed block."""
        n = self.public.params.values_per_block
        if values.shape != (n,):
            raise InvalidArgumentError(f"a block holds exactly {n} values, got {values.shape}")
        if not np.all(np.isfinite(values)):
            raise InvalidArgumentError("cannot encrypt NaN or infinite values")
        half = n // 2
        slots = values[:half] + 1j * values[half:]
        plain = seal.Plaintext()
        self._encoder.encode(slots.tolist(), self.public.params.scale, plain)
        cipher = seal.Ciphertext()
        self._encryptor.encrypt(plain, cipher)
        coeffs = self.public.coefficients_of(cipher)
        return bitpack.pack(coeffs, self.public.coeff_bits)

    def encrypt(self, vector: np.ndarray, blocks: list[int] | None = None) -> dict[int, bytes]:
        """Encrypt a flat vector; returns ``{block index: packed ciphertext}``.

        Parameters
        ----------
        vector
            The values (any float dtype), 1-D.
        blocks
            Only these block indices (default: all).
        """
        n = self.public.params.values_per_block
        flat = np.asarray(vector, dtype=np.float64).reshape(-1)
        total = num_blocks(flat.size, n)
        padded = np.zeros(total * n, dtype=np.float64)
        padded[: flat.size] = flat
        chosen = range(total) if blocks is None else blocks
        out: dict[int, bytes] = {}
        for b in chosen:
            if not 0 <= b < total:
                raise InvalidArgumentError(f"block {b} out of range [0, {total})")
            out[b] = self.encrypt_block(padded[b * n : (b + 1) * n])
        return out
