"""Blinding pads: exact cancellation in the committed sum, uniform garbage outside it.

Real SEAL keys: public-key encryptions under the default parameters, sums as a shard adds
them, decryptions as the key holder's.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, SecretContext
from crypto.blinding import Blinding
from crypto.ciphertext_sum import unpack_blocks
from fedps.ckks_params import ckks_params_from
from fedps.config import load_config
from fedps.errors import InvalidArgumentError


@functools.cache
def _keys() -> SecretContext:
    return SecretContext.generate(ckks_params_from(load_config().he))


def _encrypted(
    keys: SecretContext, values: np.ndarray, seed: bytes, blocks: list[int]
) -> np.ndarray:
    """Coefficients of ``values`` encrypted with ``seed``'s pads, as a shard unpacks them."""
    packed = BlockEncryptor(keys.public).encrypt(values, blocks, pad_seed=seed)
    return unpack_blocks(keys.public, [packed[b] for b in blocks])


def _sum(keys: SecretContext, parts: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """``sum m * c`` of every block, as a shard adds them (rows: blocks)."""
    rows = []
    for b in range(len(parts[0][0])):
        total = CiphertextSum(keys.public)
        for coeffs, multiplier in parts:
            total.add(coeffs[b], multiplier)
        rows.append(total.coefficients)
    return np.stack(rows)


def test_pads_cancel_in_the_weighted_sum_of_the_committed_contributors() -> None:
    keys = _keys()
    v = keys.public.params.values_per_block
    blocks = [0, 3]  # the indices the pads are keyed by, not the positions
    rng = np.random.default_rng(7)
    updates = [rng.uniform(-0.5, 0.5, 4 * v) for _ in range(3)]
    seeds = [os.urandom(32) for _ in updates]
    multipliers = [1, 3, 64]
    cipher = [_encrypted(keys, u, s, blocks) for u, s in zip(updates, seeds, strict=True)]
    total = _sum(keys, list(zip(cipher, multipliers, strict=True)))

    clear = Blinding(keys.public.params, keys.public.modulus).remove(
        total, blocks, zip(seeds, multipliers, strict=True)
    )

    expected = sum(m * u.reshape(4, v)[blocks] for u, m in zip(updates, multipliers, strict=True))
    decrypted = keys.open(clear, noise_weight=sum(m * m for m in multipliers))
    np.testing.assert_allclose(decrypted, expected, atol=1e-3)


def test_a_sum_without_one_contributor_decrypts_to_uniform_values() -> None:
    """The isolation a shard with a colluding client tries: victim + colluder for three."""
    keys = _keys()
    v = keys.public.params.values_per_block
    seeds = [os.urandom(32) for _ in range(3)]
    cipher = [_encrypted(keys, np.full(v, 0.25), s, [0]) for s in seeds]
    partial = _sum(keys, [(cipher[0], 1), (cipher[1], 1)])  # the third client left out

    clear = Blinding(keys.public.params, keys.public.modulus).remove(
        partial, [0], [(s, 1) for s in seeds]
    )

    decrypted = keys.decrypt(clear[0])
    # uniform modulo q: values spread over +-q / (2 scale), rarely near the true 0.5
    assert np.median(np.abs(decrypted)) > keys.public.params.max_abs_sum / 4
    assert np.mean(np.abs(decrypted - 0.5) < 1.0) < 0.02


def test_pads_are_exactly_uniform_below_q_and_keyed_by_seed_and_block() -> None:
    keys = _keys()
    blinding = Blinding(keys.public.params, keys.public.modulus)
    seed = bytes(range(32))
    pads = blinding.pads(seed, [0, 1, 0])
    q = keys.public.modulus

    assert int(pads.max()) < q
    np.testing.assert_array_equal(pads[0], pads[2])  # deterministic
    assert not np.array_equal(pads[0], pads[1])  # another block, another pad
    assert not np.array_equal(pads[0], blinding.pads(bytes(32), [0])[0])  # another seed
    # the top bit of q's length is set about (q - 2^(b-1)) / q of the time
    top = np.uint64(1 << (q.bit_length() - 1))
    share = float(np.mean(pads.reshape(-1) >= top))
    assert abs(share - (q - int(top)) / q) < 0.05


def test_the_canaries_carry_no_pad() -> None:
    keys = _keys()
    params = keys.public.params
    blinding = Blinding(params, keys.public.modulus)
    c0 = np.zeros((1, params.poly_modulus_degree), dtype=np.uint64)

    blinding.add(c0, os.urandom(32), [5])

    assert not c0[0, list(params.canary_positions)].any()
    assert c0[0, list(params.value_positions)].all()


def test_a_seed_of_another_length_is_refused() -> None:
    keys = _keys()
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        Blinding(keys.public.params, keys.public.modulus).pads(b"short", [0])


def test_a_modulus_far_below_a_power_of_two_still_gives_exact_pads() -> None:
    """About half the words are rejected: each block refills from its own second stream."""
    keys = _keys()
    q = (1 << 45) + 59  # a prime just past 2^45: a word of 46 bits is below it half the time
    blinding = Blinding(keys.public.params, q)
    seed = os.urandom(32)

    pads = blinding.pads(seed, [0, 1, 2])

    assert int(pads.max()) < q
    np.testing.assert_array_equal(pads[1], blinding.pads(seed, [1])[0])  # alone or in a range
    share = float(np.mean(pads.reshape(-1) >= np.uint64(1 << 44)))
    assert abs(share - (q - (1 << 44)) / q) < 0.05  # uniform below q, not below 2^46


def test_removing_every_pad_of_large_multipliers_is_exact() -> None:
    keys = _keys()
    q = keys.public.modulus
    blinding = Blinding(keys.public.params, q)
    n = keys.public.params.poly_modulus_degree
    seeds = [(os.urandom(32), m) for m in (1, 63, q - 1, 1 << 40)]
    padded = np.zeros((2, 2 * n), dtype=np.uint64)
    for seed, m in seeds:  # add m times each pad, in exact integers
        pads = blinding.pads(seed, [4, 9]).astype(object) * m
        values = list(keys.public.params.value_positions)
        padded[:, values] = ((padded[:, values].astype(object) + pads) % q).astype(np.uint64)

    assert not blinding.remove(padded, [4, 9], seeds).any()
