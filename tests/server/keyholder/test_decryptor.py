"""Tests for server.keyholder.decryptor's release: every block of a round flooded at once, and
the first block past the clipping bound named; and for its early opening of each shard's blocks,
which gives what one opening of every block gives, or nothing."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import BlockEncryptor, SecretContext, unpack_blocks
from fedps.config import load_config
from fedps.errors import PolicyError
from server.keyholder.decryptor import Decryptor, _EarlyOpening
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


def _ciphertexts(keys: SecretContext, blocks: int) -> np.ndarray:
    """The coefficients of ``blocks`` fresh encryptions of small values, one row each."""
    values = np.random.default_rng(5).uniform(-1, 1, (blocks, keys.public.params.values_per_block))
    encryptor = BlockEncryptor(keys.public)
    return unpack_blocks(keys.public, [encryptor.encrypt_block(row) for row in values])


def test_blocks_opened_early_shard_by_shard_are_those_of_one_opening() -> None:
    # Prepare: five blocks from two shards, the second shard's arriving first
    keys = _decryptor(encrypted=True).keys
    rows = _ciphertexts(keys, 5)
    early = _EarlyOpening(keys, 1.0)
    # Execute
    early.open([3, 4], rows[3:])
    early.open([0, 1, 2], rows[:3])
    opened = early.take([0, 1, 2, 3, 4])
    # Assert: the same values, in the order asked for; a block never opened gives nothing
    assert opened is not None
    np.testing.assert_array_equal(opened, keys.open(rows, noise_weight=1.0))
    assert early.take([0, 1, 5]) is None


def test_a_canary_that_fails_early_decrypts_nothing_of_its_shard_and_nothing_is_taken() -> None:
    # Prepare: the first shard's second block carries a change in c1
    keys = _decryptor(encrypted=True).keys
    rows = _ciphertexts(keys, 4)
    n = keys.public.params.poly_modulus_degree
    rows[1, n + 7] = (int(rows[1, n + 7]) + (1 << 20)) % keys.public.modulus
    early = _EarlyOpening(keys, 1.0)
    # Execute
    early.open([0, 1], rows[:2])
    early.open([2, 3], rows[2:])
    # Assert: nothing to take (the caller then opens every block at once, and fails there)
    assert early.take([0, 1, 2, 3]) is None
    assert not early._values.keys() & {0, 1}
