"""CKKS parameters for addition-only aggregation, and the limits that make them secure.

fedps only ever adds ciphertexts (and multiplies them by small integer constants), so it needs
no relinearisation or Galois keys and no special prime: one coefficient modulus ``q`` is
enough. The ring dimension ``N`` and ``log2 q`` are bounded by the HomomorphicEncryption.org
standard for 128-bit security (ternary secret): ``log2 q <= 54`` at N=2048, 109 at N=4096,
218 at N=8192, 438 at N=16384. SEAL limits a single prime to 60 bits.

Values are packed one per plaintext coefficient (``round(x * scale)``), except :data:`CANARIES`
coefficients of every block that are always zero: the key holder checks them before it
releases anything (:mod:`crypto.canary`). One ciphertext holds ``N - CANARIES`` values and
costs ``2 * N * ceil(log2 q)`` bits on the wire. See docs/crypto.md for the derivation of the
defaults and docs/security.md for the canaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedps.errors import ConfigError

__all__ = [
    "ASYNC_WEIGHT_BITS",
    "CANARIES",
    "MAX_COEFF_BITS_128",
    "NOISE_AT_N2048",
    "CkksParams",
]

#: Largest total coefficient-modulus size (bits) for 128-bit security, by ring dimension.
MAX_COEFF_BITS_128: dict[int, int] = {2048: 54, 4096: 109, 8192: 218, 16384: 438}

_SEAL_MAX_PRIME_BITS = 60

#: Bits of the integer staleness multipliers applied to ciphertexts in async mode.
ASYNC_WEIGHT_BITS = 6

#: Plaintext coefficients of every block reserved as zero canaries (evenly spaced, public).
CANARIES = 32

#: Largest decoding error of one fresh public-key encryption at N=2048, in units of the
#: scale (measured: 3.6e-5 * 2**30 ~ 38,650; docs/crypto.md), doubled as a safety margin.
NOISE_AT_N2048 = 2 * 38_650.0


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

    Raises
    ------
    ConfigError
        N is not a ring dimension of 128-bit security, ``coeff_modulus_bits`` is outside
        ``[20, limit]`` for N, or ``scale_bits`` outside ``[10, coeff_modulus_bits - 4]``.
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

    @classmethod
    def for_workload(
        cls, *, max_clients: int, max_abs_value: float, precision: float, extra_bits: int = 0
    ) -> CkksParams:
        """The cheapest secure parameters for summing ``max_clients`` updates.

        Each update value is at most ``max_abs_value`` in magnitude (clients clip to it), and
        the decrypted sum must be within ``precision * max_abs_value`` of the exact sum.

        - scale: the noise of a sum of K fresh ciphertexts is about ``c * sqrt(K) / scale``
          (``c`` = :data:`NOISE_AT_N2048`, growing like sqrt(N)), so
          ``scale_bits = ceil(log2(c * sqrt(K) / (precision * B)))``;
        - headroom: the sum ``K * B * scale`` must stay below ``q / 4``, so
          ``coeff_modulus_bits = scale_bits + ceil(log2(K * B)) + 2``;
        - ``extra_bits`` more headroom for integer multipliers (staleness weights);
        - security: the smallest N whose 128-bit bound admits that modulus.

        Wire cost is ``coeff_modulus_bits / 4`` bytes per value, whatever N.
        """
        if max_clients < 1 or max_abs_value <= 0 or not 0 < precision < 1:
            raise ConfigError("max_clients >= 1, max_abs_value > 0 and 0 < precision < 1")
        for n in sorted(MAX_COEFF_BITS_128):
            noise = NOISE_AT_N2048 * math.sqrt(n / 2048) * math.sqrt(max_clients)
            scale_bits = max(10, math.ceil(math.log2(noise / (precision * max_abs_value))))
            headroom = max(0, math.ceil(math.log2(max_clients * max_abs_value)))
            coeff_bits = max(20, scale_bits + 4, scale_bits + headroom + 2 + extra_bits)
            if coeff_bits <= min(MAX_COEFF_BITS_128[n], _SEAL_MAX_PRIME_BITS):
                return cls(
                    poly_modulus_degree=n, coeff_modulus_bits=coeff_bits, scale_bits=scale_bits
                )
        raise ConfigError(
            f"no single-prime parameters give precision {precision:g} for {max_clients} "
            f"clients of magnitude {max_abs_value:g}; relax one of them"
        )

    @property
    def values_per_block(self) -> int:
        """Values per ciphertext: one per coefficient, less the canaries."""
        return self.poly_modulus_degree - CANARIES

    @property
    def canary_positions(self) -> tuple[int, ...]:
        """The coefficients every client encodes as zero: ``k * N / CANARIES``."""
        step = self.poly_modulus_degree // CANARIES
        return tuple(range(0, self.poly_modulus_degree, step))

    @property
    def value_positions(self) -> tuple[int, ...]:
        """The coefficients that carry values, in order."""
        canaries = set(self.canary_positions)
        return tuple(j for j in range(self.poly_modulus_degree) if j not in canaries)

    @property
    def scale(self) -> float:
        """The CKKS encoding scale."""
        return float(2**self.scale_bits)

    @property
    def max_abs_sum(self) -> float:
        """Largest magnitude a sum of encoded values may reach: ``2**(log2 q - 2) / scale``.

        Coefficients are centred in (-q/2, q/2]; one more bit is kept as margin for the
        encryption noise and the canonical-embedding spread.
        """
        return float(2 ** (self.coeff_modulus_bits - 2 - self.scale_bits))
