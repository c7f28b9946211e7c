"""CKKS parameters for addition-only aggregation, and the limits that make them secure.

fedps only ever adds ciphertexts (and multiplies them by small integer constants), so it needs
no relinearisation or Galois keys and no special prime: one coefficient modulus ``q`` is
enough. The ring dimension ``N`` and ``log2 q`` are bounded by the HomomorphicEncryption.org
standard for 128-bit security (ternary secret): ``log2 q <= 54`` at N=2048, 109 at N=4096,
218 at N=8192, 438 at N=16384. SEAL limits a single prime to 60 bits.

Values are packed one per plaintext coefficient (``round(x * scale)``), except :data:`CANARIES`
coefficients of every block that are always zero: the key holder checks them before it
releases anything (:mod:`crypto.canary`). One ciphertext holds ``N - CANARIES`` values and
costs ``2 * N * ceil(log2 q)`` bits in full; a client sends it compressed, the low
``c0_drop_bits`` of ``c0`` (``canary_drop_bits`` at its canaries) and ``c1_drop_bits`` of
``c1`` rounded away (:mod:`crypto.compression`). See docs/crypto.md for the derivation of the
defaults and the error bound, and docs/security.md for the canaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedps.errors import ConfigError

__all__ = [
    "ASYNC_WEIGHT_BITS",
    "C1_DROP_BITS",
    "CANARIES",
    "CANARY_ROUNDING_SHARE",
    "MAX_COEFF_BITS_128",
    "NOISE_AT_N2048",
    "TAIL_SIGMAS",
    "CkksParams",
    "fresh_noise_proxy",
    "packing_params",
    "rounding_proxy",
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
#: It is the error budget of one contributor: the scale is chosen from it, the release is
#: flooded in proportion to it, and the wire compression may spend what the proven error of
#: one ciphertext (:meth:`CkksParams.value_noise_proxy`) leaves of it.
NOISE_AT_N2048 = 2 * 38_650.0

#: A bound is taken at this many sub-Gaussian standard deviations: an error above it has
#: probability at most ``2 exp(-13^2 / 2)`` < 2^-120 per coefficient (Hoeffding).
TAIL_SIGMAS = 13.0

#: Low bits of ``c1`` a client rounds away on the wire (rounding to even: ``r1`` in
#: {-1, 0, 1}, an extra ``r1 * s`` as small as a 21st of SEAL's own ``e1 * s``).
C1_DROP_BITS = 1

#: ``c0``'s canaries are rounded to ``2^dc`` with the largest ``dc`` (at most ``c0_drop_bits``)
#: whose rounding proxy is at most this share of a canary's proxy without it: the canary bound
#: grows by at most 0.8% (``sqrt(1 + 1/64)``), the blocks one key may release
#: (:func:`crypto.release.releases_per_key`) fall by at most 1.6% (docs/security.md).
CANARY_ROUNDING_SHARE = 1 / 64


def fresh_noise_proxy(n: int) -> float:
    """Sub-Gaussian variance proxy of one coefficient of a fresh encryption's error.

    ``e = e_pk * u + e0 + e1 * s`` (SEAL's ``u`` ternary, ``e0, e1`` centred binomial of
    21 + 21 bits, ``e_pk`` the public key's error): each is a sum of independent bounded
    terms, with proxies ``||e_pk||^2 <= 14 N`` (its mean is 10.5 N), ``21`` and
    ``21 wt(s) <= 21 N``: ``35 N + 21`` in all.
    """
    return 35.0 * n + 21.0


def rounding_proxy(drop_bits: int) -> float:
    """Sub-Gaussian variance proxy of the error of rounding a coefficient to ``2^drop_bits``.

    Rounding to the nearest multiple of ``2**drop_bits``, ties to even, errs by a zero-mean
    value within ``[-2^(d-1), 2^(d-1)]``, so ``4^(d-1)`` by Hoeffding's lemma (0 when nothing
    is dropped).

    Zero-mean because the rounded coefficients of a fresh ciphertext are uniform modulo q
    (they are RLWE samples; with ties to even a tie goes either way with equal chance).
    """
    return 0.0 if drop_bits == 0 else 4.0 ** (drop_bits - 1)


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
    c0_drop_bits
        Low bits of ``c0`` that a client rounds away on the wire, at every coefficient but
        the canaries (``canary_drop_bits`` there); 0: sent in full.
    c1_drop_bits
        Low bits of ``c1`` that a client rounds away on the wire; 0: sent in full.
    canary_drop_bits
        Low bits of ``c0`` that a client rounds away at the canaries, at most
        ``c0_drop_bits``; 0: the canaries of ``c0`` are sent whole.

    Raises
    ------
    ConfigError
        N is not a ring dimension of 128-bit security, ``coeff_modulus_bits`` is outside
        ``[20, limit]`` for N, ``scale_bits`` outside ``[10, coeff_modulus_bits - 4]``, a
        drop outside ``[0, scale_bits)``, or ``canary_drop_bits`` outside
        ``[0, c0_drop_bits]``.
    """

    poly_modulus_degree: int = 2048
    coeff_modulus_bits: int = 45
    scale_bits: int = 30
    c0_drop_bits: int = 0
    c1_drop_bits: int = 0
    canary_drop_bits: int = 0

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
        for name in ("c0_drop_bits", "c1_drop_bits"):
            drop = getattr(self, name)
            if not 0 <= drop < self.scale_bits:
                raise ConfigError(
                    f"{name} must be in [0, scale_bits = {self.scale_bits}), got {drop}"
                )
        if not 0 <= self.canary_drop_bits <= self.c0_drop_bits:
            raise ConfigError(
                f"canary_drop_bits must be in [0, c0_drop_bits = {self.c0_drop_bits}], "
                f"got {self.canary_drop_bits}"
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
        - security: the smallest N whose 128-bit bound admits that modulus;
        - wire: ``c1`` drops :data:`C1_DROP_BITS` low bit, ``c0`` as many as keep the proven
          error of one ciphertext, ``13 sqrt(value_noise_proxy)``, within ``c`` (the scale's
          budget), so the decrypted sum still errs by at most ``c sqrt(K) / scale``; ``c0``'s
          canaries as many as add at most :data:`CANARY_ROUNDING_SHARE` to their proxy.

        Wire cost is about ``(2 log2 q - c0_drop_bits - c1_drop_bits) / 8`` bytes per value.
        """
        if max_clients < 1 or max_abs_value <= 0 or not 0 < precision < 1:
            raise ConfigError("max_clients >= 1, max_abs_value > 0 and 0 < precision < 1")
        for n in sorted(MAX_COEFF_BITS_128):
            noise = NOISE_AT_N2048 * math.sqrt(n / 2048) * math.sqrt(max_clients)
            scale_bits = max(10, math.ceil(math.log2(noise / (precision * max_abs_value))))
            headroom = max(0, math.ceil(math.log2(max_clients * max_abs_value)))
            coeff_bits = max(20, scale_bits + 4, scale_bits + headroom + 2 + extra_bits)
            if coeff_bits <= min(MAX_COEFF_BITS_128[n], _SEAL_MAX_PRIME_BITS):
                c1_drop = min(C1_DROP_BITS, scale_bits - 1)
                c0_drop = min(_c0_drop_bits(n, c1_drop), scale_bits - 1)
                return cls(
                    poly_modulus_degree=n,
                    coeff_modulus_bits=coeff_bits,
                    scale_bits=scale_bits,
                    c0_drop_bits=c0_drop,
                    c1_drop_bits=c1_drop,
                    canary_drop_bits=min(_canary_drop_bits(n, c1_drop), c0_drop),
                )
        raise ConfigError(
            f"no single-prime parameters give precision {precision:g} for {max_clients} "
            f"clients of magnitude {max_abs_value:g}; relax one of them"
        )

    @property
    def canary_noise_proxy(self) -> float:
        """Sub-Gaussian variance proxy of one canary of one honest ciphertext as sent.

        The fresh error, ``r1 * s`` (``c1``'s rounding, ``wt(s) <= N`` terms) and ``c0``'s
        rounding at the canaries (``canary_drop_bits``).
        """
        return _shared_proxy(self.poly_modulus_degree, self.c1_drop_bits) + rounding_proxy(
            self.canary_drop_bits
        )

    @property
    def value_noise_proxy(self) -> float:
        """Sub-Gaussian variance proxy of the error of one value of one honest ciphertext.

        The fresh error, ``r1 * s`` and ``r0`` (``c0``'s rounding on the wire). A sum weighted
        by integers ``m_i`` has ``sum m_i^2`` times it.
        """
        return _shared_proxy(self.poly_modulus_degree, self.c1_drop_bits) + rounding_proxy(
            self.c0_drop_bits
        )

    def error_bound(self, noise_weight: float) -> float:
        """Proven bound on the error of one decrypted value of a sum, in value units.

        ``noise_weight`` is ``sum m_i^2`` of the sum's integer weights; the error exceeds the
        bound with probability below 2^-120 per value.
        """
        return TAIL_SIGMAS * math.sqrt(self.value_noise_proxy * noise_weight) / self.scale

    @property
    def values_per_block(self) -> int:
        """Values per ciphertext: one per coefficient, less the canaries."""
        return self.poly_modulus_degree - CANARIES

    @property
    def wire_bits(self) -> int:
        """Bits of one block as a client sends it: ``N (2 log2 q - d0 - d1) + 32 (d0 - dc)``.

        The compressed form (:mod:`crypto.compression`), up to the rounding of each width to
        whole bits of ``ceil(q / 2^d)``.
        """
        n, bits = self.poly_modulus_degree, self.coeff_modulus_bits
        dropped = n * (self.c0_drop_bits + self.c1_drop_bits)
        return 2 * n * bits - dropped + CANARIES * (self.c0_drop_bits - self.canary_drop_bits)

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


def packing_params(field_bits: int, max_clients: int) -> tuple[CkksParams, int]:
    """The cheapest parameters that pack fields of ``field_bits`` bits, and how many per value.

    A plaintext coefficient holds ``K`` fields of ``w = field_bits`` bits above ``g`` guard
    bits: ``sum_k u_k 2^(g + k w)``, encoded as the value ``sum_k u_k 2^(k w)`` at scale
    ``2^g`` (docs/crypto.md, *Quantized packing*). Every sum of at most ``max_clients``
    ciphertexts must decode exactly:

    - guard: the proven error of the sum, ``13 sqrt(max_clients x value_noise_proxy)``
      (exceeded with probability below 2^-120 per value), stays below half the lowest
      field's step: ``g = floor(log2(bound)) + 2``;
    - headroom: the sum stays below ``q / 4``, as for real values (sign, and the margin of
      :attr:`CkksParams.max_abs_sum`): ``log2 q = g + K w + 2``;
    - fields: ``K = floor((limit - 2 - g) / w)``, ``limit`` the 128-bit bound for N (and
      SEAL's 60-bit prime);
    - security: the smallest N whose bound admits one field;
    - wire: ``c1`` drops :data:`C1_DROP_BITS` bit, its canaries as for real values, and
      ``c0`` the ``d0`` bits (each one raising the guard's bound) that make a value cheapest:
      the least :attr:`CkksParams.wire_bits` per field sent.

    Parameters
    ----------
    field_bits
        Bits of one field: a quantized value's bits plus ``ceil(log2(max_clients))``, so the
        sum of ``max_clients`` of them fits.
    max_clients
        Most ciphertexts one sum adds.

    Returns
    -------
    tuple[CkksParams, int]
        The parameters (``scale_bits`` is the guard ``g``) and the fields per coefficient
        ``K`` (at least 1).

    Raises
    ------
    ConfigError
        No ring dimension holds one field (``K < 1``).
    """
    if field_bits < 1 or max_clients < 1:
        raise ConfigError("field_bits >= 1 and max_clients >= 1")
    for n in sorted(MAX_COEFF_BITS_128):
        best: tuple[float, CkksParams, int] | None = None
        limit = min(MAX_COEFF_BITS_128[n], _SEAL_MAX_PRIME_BITS)
        c1_drop = C1_DROP_BITS
        for c0_drop in range(limit):
            proxy = _shared_proxy(n, c1_drop) + rounding_proxy(c0_drop)
            guard = math.floor(math.log2(TAIL_SIGMAS * math.sqrt(proxy * max_clients))) + 2
            fields = (limit - 2 - guard) // field_bits
            if fields < 1 or c0_drop >= guard:
                break  # a larger drop only raises the guard
            params = CkksParams(
                poly_modulus_degree=n,
                coeff_modulus_bits=max(20, guard + 4, guard + fields * field_bits + 2),
                scale_bits=guard,
                c0_drop_bits=c0_drop,
                c1_drop_bits=c1_drop,
                canary_drop_bits=min(_canary_drop_bits(n, c1_drop), c0_drop),
            )
            cost = params.wire_bits / (fields * params.values_per_block)
            if best is None or cost < best[0]:
                best = (cost, params, fields)
        if best is not None:
            return best[1], best[2]
    raise ConfigError(
        f"a field of {field_bits} bits does not fit one coefficient at 128-bit security"
    )


def _shared_proxy(n: int, c1_drop_bits: int) -> float:
    """The proxy every coefficient of a ciphertext as sent carries: fresh error and ``r1 s``."""
    return fresh_noise_proxy(n) + n * rounding_proxy(c1_drop_bits)


def _most_drop_bits(left: float) -> int:
    """The most low bits whose rounding proxy is at most ``left``."""
    drop = 0
    while rounding_proxy(drop + 1) <= left:
        drop += 1
    return drop


def _c0_drop_bits(n: int, c1_drop_bits: int) -> int:
    """The most low bits of ``c0`` a client may round away at ring dimension ``n``.

    Their rounding keeps the proven error of one ciphertext within the budget
    :data:`NOISE_AT_N2048` ``* sqrt(N / 2048)``.
    """
    budget = (NOISE_AT_N2048 * math.sqrt(n / 2048) / TAIL_SIGMAS) ** 2
    return _most_drop_bits(budget - _shared_proxy(n, c1_drop_bits))


def _canary_drop_bits(n: int, c1_drop_bits: int) -> int:
    """The most low bits of ``c0``'s canaries a client may round away at ring dimension ``n``.

    Their rounding adds at most :data:`CANARY_ROUNDING_SHARE` to a canary's proxy.
    """
    return _most_drop_bits(CANARY_ROUNDING_SHARE * _shared_proxy(n, c1_drop_bits))
