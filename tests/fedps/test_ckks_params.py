"""The run's CKKS parameters from its configuration, quantized packing included."""

from __future__ import annotations

import pytest

from fedps.ckks_params import ckks_params, quantized_packing, upload_fields
from fedps.config import load_config
from fedps.errors import ConfigError


def test_without_bits_the_parameters_are_plain_packings() -> None:
    # Prepare
    config = load_config(None)

    # Execute / Assert
    assert quantized_packing(config) is None and upload_fields(config) == 1
    assert (ckks_params(config).coeff_modulus_bits, ckks_params(config).scale_bits) == (46, 37)


def test_bits_give_every_role_the_packings_parameters() -> None:
    # Prepare
    config = load_config(None, compression={"bits": 8})

    # Execute
    packing = quantized_packing(config)

    # Assert
    assert packing is not None and packing.fields == upload_fields(config) == 2
    assert ckks_params(config) == packing.params


def test_bits_that_save_nothing_stop_a_role_from_starting() -> None:
    # Prepare: plain packing at a coarse precision is cheaper than one 16-bit field
    config = load_config(None, compression={"bits": 16}, he={"precision": 1e-2})

    # Execute / Assert
    with pytest.raises(ConfigError, match="saves nothing"):
        ckks_params(config)
