"""Release hygiene: flooding noise has the documented standard deviation."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, CkksParams, SecretContext
from crypto.release import decryption_error_bound, flood_and_round, released_std


@pytest.mark.parametrize("flood_bits", [4, 10])
def test_released_minus_exact_has_the_documented_std(flood_bits: int) -> None:
    # Prepare: a real encrypted sum of 5 updates, decrypted
    params = CkksParams.for_workload(max_clients=5, max_abs_value=1.0, precision=1e-5)
    keys = SecretContext.generate(params)
    encryptor = BlockEncryptor(keys.public)
    n = params.values_per_block
    values = np.random.default_rng(0).uniform(-1, 1, (5, n))
    total = CiphertextSum(keys.public)
    for row in values:
        total.add_packed(encryptor.encrypt_block(row))
    exact = values.sum(axis=0)
    sigma = 2.0**flood_bits * decryption_error_bound(params, 5)
    # Execute: release the same decryption many times (fresh noise each time)
    diffs = np.concatenate(
        [flood_and_round(keys.decrypt(total.coefficients), sigma) - exact for _ in range(8)]
    )
    # Assert: std within 3% of sigma * sqrt(1 + 1/192), mean near 0, values on the grid
    expected = released_std(sigma)
    assert abs(diffs.std() / expected - 1) < 0.03
    assert abs(diffs.mean()) < 4 * expected / np.sqrt(diffs.size)
    released = flood_and_round(exact, sigma)
    np.testing.assert_allclose(released / (sigma / 4), np.round(released / (sigma / 4)))


def test_decryption_error_is_within_the_bound() -> None:
    # Prepare
    params = CkksParams.for_workload(max_clients=10, max_abs_value=1.0, precision=1e-5)
    keys = SecretContext.generate(params)
    encryptor = BlockEncryptor(keys.public)
    values = np.random.default_rng(1).uniform(-1, 1, (10, params.values_per_block))
    total = CiphertextSum(keys.public)
    for row in values:
        total.add_packed(encryptor.encrypt_block(row))
    # Execute
    error = np.abs(keys.decrypt(total.coefficients) - values.sum(axis=0)).max()
    # Assert
    assert error <= decryption_error_bound(params, 10)
