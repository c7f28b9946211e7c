"""What a shard that knows the round's challenge can hand over.

A forged aggregate whose sketch is the committed one: the attack of the tests named
``..._a_shard_with_a_colluding_client_cannot_isolate_one_client`` (quantized and plain packing).
"""

from __future__ import annotations

import hashlib

import numpy as np

from crypto import PublicContext
from crypto.sketch import Challenge
from tests.round_driver import HandClient

__all__ = ["isolating_aggregate"]


def small_solution(weights: list[int], target: int, q: int) -> list[int]:
    """``z`` in ``{-1, 0, 1}^len(weights)`` with ``sum weights_j z_j = target (mod q)``.

    Repeated differencing: the target's item takes the nearest item of the pool, the rest of
    the pool is paired (sorted, neighbours subtracted) into items a factor of its size smaller,
    with disjoint supports, until the target's item is small; a search over signed subsets of
    the small items left then cancels it exactly.
    """

    def centre(v: int) -> int:
        v %= q
        return v - q if v > q // 2 else v

    def merged(a: dict[int, int], b: dict[int, int], sign: int) -> dict[int, int]:
        out = dict(a)
        for k, c in b.items():
            out[k] = out.get(k, 0) + sign * c
        return out

    pool = [(centre(w), {j: 1}) for j, w in enumerate(weights)]
    value, comb = centre(-target), {-1: 1}  # key -1: the target's coefficient
    while abs(value) > 64 or len(pool) > 64:
        assert len(pool) >= 16, "no small solution"
        best = min(
            range(len(pool)), key=lambda i: min(abs(value - pool[i][0]), abs(value + pool[i][0]))
        )
        v, other = pool.pop(best)
        sign = -1 if abs(value - v) <= abs(value + v) else 1
        value, comb = centre(value + sign * v), merged(comb, other, sign)
        pool.sort(key=lambda item: item[0])
        pool = [
            (centre(b[0] - a[0]), merged(b[1], a[1], -1))
            for a, b in zip(pool[0::2], pool[1::2], strict=False)
        ]
    reach: dict[int, tuple[tuple[int, dict[int, int]], ...]] = {0: ()}
    for v, other in pool:
        for total, used in list(reach.items()):
            for sign in (1, -1):
                if abs(total + sign * v) <= 1 << 12:
                    reach.setdefault(total + sign * v, (*used, (sign, other)))
    for sign, other in reach[-value]:
        comb = merged(comb, other, sign)
    flip = comb.pop(-1)
    z = [0] * len(weights)
    for k, c in comb.items():
        z[k] = c * flip
    return z


def isolating_aggregate(
    challenge: Challenge,
    public: PublicContext,
    block: int,
    kept: list[HandClient],
    left_out: HandClient,
) -> np.ndarray:
    """The sum of ``kept``'s ciphertexts of ``block`` that passes for ``kept`` + ``left_out``.

    A correction ``Y`` in ``c0`` at the value positions, entries in {-1, 0, 1} (far below the
    decryption error), makes its sketch ``<r, c_kept> + <r, c_left_out>``: what the shard needs
    is the challenge (from a colluding cohort client) and the left-out client's push.

    Returns
    -------
    np.ndarray
        ``(1, 2N)`` uint64 coefficients.
    """
    assert challenge.count == 1
    q = public.modulus
    stream = hashlib.shake_256(b"fedps-sketch-v1" + challenge.seed).digest(
        8 * challenge.coeffs_per_block
    )
    words = np.frombuffer(stream, dtype="<u8")  # the challenge r, as Challenge expands it
    positions = list(public.params.value_positions)
    target = int(challenge.sketch(left_out.sent_coefficients[block : block + 1])[0, 0])
    z = small_solution([int(words[j]) % q for j in positions], target, q)
    row = sum(c.sent_coefficients[block].astype(object) for c in kept)
    row[positions] += np.array(z, dtype=object)
    out = np.array([int(v) % q for v in row], dtype=np.uint64)[None, :]
    committed = sum(
        int(challenge.sketch(c.sent_coefficients[block : block + 1])[0, 0]) for c in kept
    )
    assert int(challenge.sketch(out)[0, 0]) == (committed + target) % q
    return out
