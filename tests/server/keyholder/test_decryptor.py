"""Tests for server.keyholder.decryptor's release: every block of a round flooded at once, and
the first block past the clipping bound named."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import SecretContext
from fedps.config import load_config
from fedps.errors import PolicyError
from server.keyholder.decryptor import Decryptor
from server.serve import keyholder_settings


def _decryptor(*, encrypted: bool) -> Decryptor:
    config = load_config(None, he={"enabled": encrypted}, security={"flood_bits": 8})
    settings = keyholder_settings(config)
    return Decryptor(SecretContext.generate(settings.params), settings)


def test_every_block_is_flooded_onto_the_grid_in_one_draw() -> None:
    # Prepare: three blocks of two contributors' sums, well within the bound
    decryptor = _decryptor(encrypted=True)
    summed = np.full((3, 16), 0.25)
    # Execute
    released = decryptor._release(summed, [1, 1], [4, 9, 2])
    # Assert: every value moved by the noise, and on the rounding grid
    assert released.shape == summed.shape and not np.any(released == summed)
    grid = np.abs(np.diff(np.unique(released))).min()
    assert np.allclose(released / grid, np.round(released / grid))


def test_the_first_block_past_the_clipping_bound_is_named_and_nothing_released() -> None:
    # Prepare: encryption off (nothing flooded); block 9's sum exceeds 2 x max_abs_value
    decryptor = _decryptor(encrypted=False)
    summed = np.zeros((3, 16))
    summed[1, 5] = 3.0
    summed[2, 0] = -3.0
    # Execute / Assert
    with pytest.raises(PolicyError, match="block 9: a decrypted sum exceeds the bound"):
        decryptor._release(summed, [1, 1], [4, 9, 2])
