"""Quantized packing: the derivation, exact round trips and sums, unbiased rounding, overflow."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto import BlockEncryptor, CiphertextSum, CkksParams, SecretContext, unpack_block
from crypto.quantized_packing import OffGridError, QuantizedPacking
from fedps.errors import ConfigError, InvalidArgumentError

_PLAIN = CkksParams.for_workload(max_clients=100, max_abs_value=1.0, precision=1e-5)


def _packing(bits: int = 8, max_clients: int = 100) -> QuantizedPacking:
    return QuantizedPacking.derive(
        bits=bits, max_clients=max_clients, max_abs_value=1.0, plain=_PLAIN
    )


@pytest.fixture(scope="module")
def packing() -> QuantizedPacking:
    return _packing()


@pytest.fixture(scope="module")
def keys(packing: QuantizedPacking) -> SecretContext:
    return SecretContext.generate(packing.params)


# --------------------------------------------------------------------------- the derivation


def test_eight_bits_for_a_hundred_clients_pack_two_to_a_coefficient(
    packing: QuantizedPacking,
) -> None:
    # Assert: docs/crypto.md's figures, and the guard they rest on
    params = packing.params
    assert (packing.fields, packing.field_bits) == (2, 15)
    assert (params.poly_modulus_degree, params.coeff_modulus_bits, params.scale_bits) == (
        2048,
        49,
        17,
    )
    assert (params.c0_drop_bits, params.c1_drop_bits, params.canary_drop_bits) == (9, 1, 6)
    assert params.error_bound(100) < 0.5  # below half a step of the lowest field
    assert 2 ** (packing.fields * packing.field_bits) <= 2 ** (params.coeff_modulus_bits - 2)
    assert packing.bytes_per_value == pytest.approx(5.59, abs=0.01)


def test_sixteen_bits_fit_one_to_a_coefficient_and_still_cost_less() -> None:
    # Execute
    packing = _packing(bits=16)

    # Assert
    assert packing.fields == 1
    assert packing.bytes_per_value < _PLAIN.wire_bits / 8 / _PLAIN.values_per_block


def test_a_packing_that_saves_nothing_is_refused() -> None:
    # Prepare: plain packing at a coarse precision is already cheaper than 16-bit fields
    coarse = CkksParams.for_workload(max_clients=100, max_abs_value=1.0, precision=1e-2)

    # Execute / Assert
    with pytest.raises(ConfigError, match="saves nothing"):
        QuantizedPacking.derive(bits=16, max_clients=100, max_abs_value=1.0, plain=coarse)


@pytest.mark.parametrize("bits", [0, 17])
def test_bits_outside_one_to_sixteen_are_refused(bits: int) -> None:
    with pytest.raises(ConfigError, match="1 to 16 bits"):
        _packing(bits=bits)


# --------------------------------------------------------------------------- round trips


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([1, 4, 8, 12]), size=st.integers(1, 9000), seed=st.integers(0, 2**32))
def test_pack_then_unpack_is_exact_for_integers_in_range(bits: int, size: int, seed: int) -> None:
    # Prepare
    packing = _packing(bits=bits)
    quantized = np.random.default_rng(seed).integers(0, packing.levels + 1, size)

    # Execute
    packed = packing.pack(quantized)
    rows = packed.reshape(-1, packing.params.values_per_block)
    unpacked = packing.unpack(rows, contributors=1, noise_weight=1)

    # Assert
    assert packed.size % packing.params.values_per_block == 0
    assert np.array_equal(unpacked.reshape(-1)[:size], quantized)
    assert not unpacked.reshape(-1)[size:].any()  # the padding


def test_a_sum_of_max_clients_encrypted_contributions_decodes_exactly(
    packing: QuantizedPacking, keys: SecretContext
) -> None:
    # Prepare: 100 clients, the extremes included (every field at 0 or at 2^B - 1 at once)
    rng = np.random.default_rng(7)
    per_block = packing.values_per_block
    updates = [rng.integers(0, packing.levels + 1, per_block) for _ in range(100)]
    for update in updates:
        update[:10], update[10:20] = 0, packing.levels
    encryptor = BlockEncryptor(keys.public)
    total = CiphertextSum(keys.public)

    # Execute: each client encrypts as it sends; a shard adds; the key holder opens and unpacks
    for update in updates:
        blocks, _ = encryptor.encrypt_with_coefficients(packing.pack(update))
        total.add_packed(blocks[0])
    rows = keys.open(unpack_block(keys.public, total.packed())[None], noise_weight=100)
    sums = packing.unpack(rows, contributors=100, noise_weight=100)

    # Assert
    assert np.array_equal(sums[0], np.sum(updates, axis=0))
    assert sums[0][10:20].tolist() == [100 * packing.levels] * 10


# --------------------------------------------------------------------------- rounding


def test_stochastic_rounding_is_unbiased(packing: QuantizedPacking) -> None:
    # Prepare: values between grid points, each quantized many times
    draws = 20_000
    values = np.array([-1.0, -0.4321, -0.003, 0.0, 0.001, 0.25, 0.777, 1.0])
    rng = np.random.default_rng(2026)

    # Execute
    quantized = packing.quantize(np.tile(values, draws), rng).reshape(draws, -1)
    means = packing.dequantize(quantized, 1).mean(axis=0)

    # Assert: within 6 sigma of the mean's standard deviation (a value's rounding has variance
    # at most step^2 / 4)
    sigma = packing.step / 2 / math.sqrt(draws)
    assert np.all(np.abs(means - values) <= 6 * sigma)
    assert quantized.min() >= 0 and quantized.max() <= packing.levels


def test_values_beyond_the_range_are_clipped(packing: QuantizedPacking) -> None:
    quantized = packing.quantize(np.array([-5.0, 5.0]), np.random.default_rng(0))
    assert quantized.tolist() == [0, packing.levels]


# --------------------------------------------------------------------------- refusals


def test_a_field_above_what_its_contributors_allow_is_refused(packing: QuantizedPacking) -> None:
    # Prepare: two contributions whose sum reaches a field 2 (2^B - 1) cannot reach
    rows = packing.pack(np.full(4, packing.levels)).reshape(1, -1) * 3

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="overflowed"):
        packing.unpack(rows, contributors=2, noise_weight=2)


@pytest.mark.parametrize("value", [-1.0, 2.0**30])
def test_a_sum_outside_the_fields_is_refused(packing: QuantizedPacking, value: float) -> None:
    rows = np.zeros((1, packing.params.values_per_block))
    rows[0, 5] = value
    with pytest.raises(InvalidArgumentError, match="overflowed"):
        packing.unpack(rows, contributors=100, noise_weight=100)


def test_a_sum_off_the_grid_is_refused(packing: QuantizedPacking) -> None:
    # Prepare: farther from an integer than the proven decryption error of 100 contributions
    rows = np.zeros((1, packing.params.values_per_block))
    rows[0, 3] = 7 + 1.01 * packing.params.error_bound(100)

    # Execute / Assert: an error of its own, for the key holder replaces the key that answered
    with pytest.raises(OffGridError, match="farther from an integer"):
        packing.unpack(rows, contributors=100, noise_weight=100)


def test_more_contributors_than_the_headroom_are_refused(packing: QuantizedPacking) -> None:
    with pytest.raises(InvalidArgumentError, match="1 to 100"):
        packing.unpack(np.zeros((1, 4)), contributors=101, noise_weight=101)
