"""Tests for the block combinations of crypto.joint_canary: exact modulo q."""

from __future__ import annotations

import numpy as np
import pytest

from crypto.joint_canary import _combine_blocks, canary_weights
from crypto.rlwe import uniform
from fedps.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("modulus", "blocks", "width"),
    [((1 << 46) - 139, 37, 64), ((1 << 54) - 33, 5, 32), (1_000_003, 1, 8), (97, 0, 4)],
)
def test_combinations_equal_exact_integer_sums(modulus: int, blocks: int, width: int) -> None:
    # Prepare: coefficients uniform below q, the weights of some aggregate's digest
    polys = uniform(blocks, width, modulus)
    weights = canary_weights(b"an aggregate's digest", blocks)
    # Execute
    got = _combine_blocks(weights, polys, modulus)
    # Assert: Python's integers agree
    exact = [
        [
            sum(int(r) * int(c) for r, c in zip(row, column, strict=True)) % modulus
            for column in polys.T
        ]
        for row in weights
    ]
    assert got.dtype == np.uint64
    assert np.array_equal(got, np.array(exact, dtype=np.uint64).reshape(len(weights), width))


def test_combinations_refuse_a_modulus_beyond_int64_recombination() -> None:
    with pytest.raises(InvalidArgumentError):
        _combine_blocks(canary_weights(b"d", 1), np.zeros((1, 4), dtype=np.uint64), 1 << 55)
