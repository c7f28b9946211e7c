"""Workload-derived CKKS parameters: secure, cheapest, and meeting the stated precision."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, CkksParams, SecretContext
from crypto.params import MAX_COEFF_BITS_128
from fedps.ckks_params import ckks_params_from
from fedps.config import load_config
from fedps.errors import ConfigError


@pytest.mark.parametrize(
    ("clients", "bound", "precision"),
    [(100, 1.0, 1e-5), (1000, 1.0, 1e-5), (10, 1.0, 1e-5), (100, 16.0, 1e-5), (4, 0.1, 1e-6)],
)
def test_derived_parameters_are_secure_and_have_headroom(
    clients: int, bound: float, precision: float
) -> None:
    # Execute
    params = CkksParams.for_workload(max_clients=clients, max_abs_value=bound, precision=precision)
    # Assert: 128-bit bound, and the worst-case sum fits below q / 4
    assert params.coeff_modulus_bits <= MAX_COEFF_BITS_128[params.poly_modulus_degree]
    assert clients * bound <= params.max_abs_sum


def test_default_workload_costs_under_twelve_bytes_per_value() -> None:
    params = ckks_params_from(load_config().he)
    assert params.coeff_modulus_bits / 4 <= 12


def test_impossible_workload_is_refused() -> None:
    with pytest.raises(ConfigError, match="relax"):
        CkksParams.for_workload(max_clients=10**9, max_abs_value=1e6, precision=1e-12)


def test_fixed_parameters_in_config_win() -> None:
    he = load_config(
        None, he={"poly_modulus_degree": 4096, "coeff_modulus_bits": 50, "scale_bits": 40}
    ).he
    assert ckks_params_from(he) == CkksParams(4096, 50, 40)


def test_sum_of_max_clients_meets_the_precision() -> None:
    """Sum 20 updates at the bound: the error is within precision * bound."""
    # Prepare
    params = CkksParams.for_workload(max_clients=20, max_abs_value=1.0, precision=1e-5)
    keys = SecretContext.generate(params)
    encryptor = BlockEncryptor(keys.public)
    n = params.values_per_block
    values = np.random.default_rng(0).choice([-1.0, 1.0], size=(20, n))
    total = CiphertextSum(keys.public)
    # Execute
    for row in values:
        total.add_packed(encryptor.encrypt_block(row))
    decrypted = keys.decrypt(total.coefficients)
    # Assert: no wrap-around even when every value sits at the bound with the same sign
    assert np.abs(decrypted - values.sum(axis=0)).max() < 1e-5
