"""The coefficient encoder: one value per coefficient, zero canaries, and SEAL agrees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto import BlockEncryptor, CkksParams, SecretContext, bitpack
from crypto.ckks_encoder import CkksEncoder
from crypto.params import CANARIES
from fedps.errors import InvalidArgumentError

N = 2048
PARAMS = CkksParams(poly_modulus_degree=N, coeff_modulus_bits=45, scale_bits=30)
V = PARAMS.values_per_block
Q = (1 << 45) - 55


@pytest.fixture(scope="module")
def keys() -> SecretContext:
    return SecretContext.generate(PARAMS)


def _centred(coeffs: np.ndarray, q: int) -> np.ndarray:
    ints = coeffs.astype(np.int64)
    out: np.ndarray = np.where(ints > q // 2, ints - q, ints)
    return out


def test_canaries_are_evenly_spaced_and_values_fill_the_rest() -> None:
    canaries, values = PARAMS.canary_positions, PARAMS.value_positions
    assert len(canaries) == CANARIES and V == N - CANARIES
    assert canaries == tuple(range(0, N, N // CANARIES))
    assert sorted(canaries + values) == list(range(N))


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.integers(1, 4),
    magnitude=st.sampled_from([1e-4, 1.0, 8.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_encode_decode_round_trip_keeps_canaries_zero(
    blocks: int, magnitude: float, seed: int
) -> None:
    # Prepare
    encoder = CkksEncoder(PARAMS, Q)
    values = np.random.default_rng(seed).uniform(-magnitude, magnitude, (blocks, V))
    # Execute
    coeffs = encoder.encode(values)
    decoded = encoder.decode(_centred(coeffs, Q))
    # Assert: only the rounding to integers is lost; the canaries are exactly zero
    assert np.abs(decoded - values).max() <= 0.5 / PARAMS.scale
    assert not coeffs[:, list(PARAMS.canary_positions)].any()


def test_seal_decrypts_our_encoding(keys: SecretContext) -> None:
    """Our encoding added to an encryption of zero decrypts, by SEAL's own decryptor, to the
    values in order: the numpy decryption agrees with SEAL's bit for bit."""
    # Prepare
    values = np.random.default_rng(0).normal(0, 1, V)
    encryptor = BlockEncryptor(keys.public)
    row = bitpack.unpack(encryptor.encrypt_block(values), 2 * N, 45)
    # Execute
    ours = keys._decrypt_centred(row[None])[0]
    seal = keys._seal_decrypt(row).astype(np.int64)
    # Assert
    np.testing.assert_array_equal(_centred(seal.astype(np.uint64), keys.public.modulus), ours)
    np.testing.assert_allclose(keys.decrypt(row), values, atol=1e-5)


def test_canaries_alone_equal_those_of_the_whole_decryption(keys: SecretContext) -> None:
    # Prepare
    encryptor = BlockEncryptor(keys.public)
    _, rows = encryptor.encrypt_with_coefficients(np.random.default_rng(2).normal(0, 1, 3 * V))
    # Execute
    canaries = keys.canaries(rows)
    whole = keys._decrypt_centred(rows)
    # Assert: the same coefficients, and only noise there
    np.testing.assert_array_equal(canaries, whole[:, list(PARAMS.canary_positions)])
    assert 0 < np.abs(canaries).max() < 2000


def test_encode_rejects_bad_input() -> None:
    encoder = CkksEncoder(PARAMS, Q)
    with pytest.raises(InvalidArgumentError):
        encoder.encode(np.zeros((1, V - 1)))
    with pytest.raises(InvalidArgumentError):
        encoder.encode(np.full((1, V), np.nan))
    with pytest.raises(InvalidArgumentError, match="magnitude"):
        encoder.encode(np.full((1, V), 1e9))


def test_zeros_are_used_once(keys: SecretContext) -> None:
    """Each encryption of zero encrypts exactly one block: two encryptions of the same values
    differ (fresh randomness), and the pool shrinks."""
    # Prepare
    encryptor = BlockEncryptor(keys.public)
    encryptor.precompute(3)
    # Execute
    first = encryptor.encrypt_block(np.zeros(V))
    second = encryptor.encrypt_block(np.zeros(V))
    # Assert
    assert first != second
    assert encryptor.pooled == 1


def test_canaries_are_exact_for_the_largest_coefficients() -> None:
    """Every c1 coefficient at q - 1 under a 51-bit q: the limb products exceed float64's
    exact range once recombined, so the canaries must be recombined in integers."""
    # Prepare
    params = CkksParams(poly_modulus_degree=N, coeff_modulus_bits=51, scale_bits=30)
    keys = SecretContext.generate(params)
    q = keys.public.modulus
    rows = np.full((2, 2 * N), q - 1, dtype=np.uint64)
    rows[1, N:] = np.random.default_rng(4).integers(q // 2, q, N, dtype=np.uint64)
    # Execute
    canaries = keys.canaries(rows)
    # Assert
    whole = keys._decrypt_centred(rows)
    np.testing.assert_array_equal(canaries, whole[:, list(params.canary_positions)])
