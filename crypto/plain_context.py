"""Encryption switched off: the insecure plaintext baseline that benchmarks compare against.

With ``[he] enabled = false`` every role uses this instead of a :class:`PublicContext`: blocks
travel as little-endian float64 values and shards add them in the clear. It exists so that
``fedps bench`` can time the same round with and without encryption; it logs a warning
wherever it is used, and clients and shards accept it only when their own configuration
disables encryption (a server cannot downgrade a client).
"""

from __future__ import annotations

import numpy as np

from fedps.errors import InvalidArgumentError

__all__ = ["PLAINTEXT_CONTEXT_ID", "PlainContext"]

#: The context id that names "no encryption".
PLAINTEXT_CONTEXT_ID = "plaintext-insecure"


class PlainContext:
    """Plaintext blocks of ``values_per_block`` float64 values."""

    context_id = PLAINTEXT_CONTEXT_ID

    def __init__(self, values_per_block: int) -> None:
        self.values_per_block = values_per_block

    @property
    def block_bytes(self) -> int:
        """Exact size of one block on the wire."""
        return 8 * self.values_per_block

    def encrypt(self, vector: np.ndarray) -> dict[int, bytes]:
        """Cut a flat vector into blocks of float64 bytes (no encryption)."""
        return self.encrypt_with_coefficients(vector)[0]

    def encrypt_with_coefficients(self, vector: np.ndarray) -> tuple[dict[int, bytes], np.ndarray]:
        """The blocks as bytes, and as a (B, N) float64 array."""
        n = self.values_per_block
        flat = np.asarray(vector, dtype="<f8").reshape(-1)
        total = max(1, -(-flat.size // n))
        padded = np.zeros(total * n, dtype="<f8")
        padded[: flat.size] = flat
        rows = padded.reshape(total, n)
        return {b: rows[b].tobytes() for b in range(total)}, rows

    def unpack_blocks(self, data: list[bytes]) -> np.ndarray:
        """Validate blocks (exact length, finite values); returns shape (B, N) float64."""
        if not data:
            return np.empty((0, self.values_per_block))
        for i, item in enumerate(data):
            if len(item) != self.block_bytes:
                raise InvalidArgumentError(
                    f"plaintext block #{i} must be exactly {self.block_bytes} bytes, "
                    f"got {len(item)}"
                )
        rows = np.frombuffer(b"".join(data), dtype="<f8").reshape(len(data), -1)
        if not np.all(np.isfinite(rows)):
            raise InvalidArgumentError("plaintext block holds NaN or infinite values")
        return rows.astype(np.float64)
