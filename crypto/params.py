"""CKKS parameters for addition-only aggregation, and the limits that make them secure.

fedps only ever adds ciphertexts (and multiplies them by small integer constants), so it needs
no relinearisation or Galois keys and no special prime: one coefficient modulus ``q`` is
enough. The ring dimension ``N`` and ``log2 q`` are bounded by the HomomorphicEncryption.org
standard for 128-bit security (ternary secret): ``log2 q <= 54`` at N=2048, 109 at N=4096,
218 at N=8192, 438 at N=16384. SEAL limits a single prime to 60 bits.

Each complex slot carries two reals (real and imaginary part), so one ciphertext holds
``N`` real values and costs ``2 * N * ceil(log2 q)`` bits on the wire: ``log2(q) / 4`` bytes
per value. See docs/crypto.md for the derivation of the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedps.errors import ConfigError

__all__ = ["MAX_COEFF_BITS_128", "CkksParams"]

#: Largest total coefficient-modulus size (bits) for 128-bit security, by ring dimension.
MAX_COEFF_BITS_128: dict[int, int] = {2048: 54, 4096: 109, 8192: 218, 16384: 438}

_SEAL_MAX_PRIME_BITS = 60


@dataclass(frozen=True)
class CkksParams:
    """Parameters of the addition-only CKKS scheme.

    Parameters
    ----------
    poly_modulus_degree
        Ring dimension N; a ciphertext holds N real values.
    coeff_modulus_bits
        Size of the single coefficient prime q, in bits.
    scale_bits
        log2 of the CKKS scale: values are encoded as ``round(x * 2**scale_bits)``.
    """

    poly_modulus_degree: int = 2048
    coeff_modulus_bits: int = 45
    scale_bits: int = 30

    def __post_init__(self) -> None:
        n = self.poly_modulus_degree
        if n not in MAX_COEFF_BITS_128:
            raise ConfigError(
                f"poly_modulus_degree must be one of {sorted(MAX_COEFF_BITS_128)}, got {n}"
            )
        limit = min(MAX_COEFF_BITS_128[n], _SEAL_MAX_PRIME_BITS)
        if not 20 <= self.coeff_modulus_bits <= limit:
            raise ConfigError(
                f"coeff_modulus_bits must be in [20, {limit}] for 128-bit security at "
                f"N={n}, got {self.coeff_modulus_bits}"
            )
        if not 10 <= self.scale_bits <= self.coeff_modulus_bits - 4:
            raise ConfigError(
                f"scale_bits must be in [10, coeff_modulus_bits - 4 = "
                f"{self.coeff_modulus_bits - 4}], got {self.scale_bits}"
            )

    @property
    def values_per_block(self) -> int:
        """Real values per ciphertext (two per complex slot)."""
        return self.poly_modulus_degree

    @property
    def scale(self) -> float:
        """The CKKS encoding scale."""
        return float(2**self.scale_bits)

    @property
    def max_abs_sum(self) -> float:
        """Largest magnitude a sum of encoded values may reach before it wraps modulo q.

        Coefficients are centred in (-q/2, q/2]; one bit is kept as margin for the encryption
        noise and the canonical-embedding spread.
        """
        return float(2 ** (self.coeff_modulus_bits - 2 - self.scale_bits))
