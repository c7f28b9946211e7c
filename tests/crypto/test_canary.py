"""Tests for crypto.canary's roots in one pass: the same commitment as one opening at a time."""

from __future__ import annotations

import numpy as np
import pytest

from crypto.canary import CanaryOpening, opening_roots
from crypto.signing import chunk_root, chunk_roots
from fedps.errors import InvalidArgumentError

Q = (1 << 46) - 1


def test_the_roots_of_many_ciphertexts_are_the_roots_of_their_openings() -> None:
    # Prepare: 2N = 4096 coefficients, every other row (a view that is not contiguous)
    rows = np.random.default_rng(3).integers(0, Q, size=(9, 4096), dtype=np.uint64)
    picked = rows[::2]
    # Execute
    roots = opening_roots(picked)
    # Assert
    assert roots == [CanaryOpening.of(row).root() for row in picked]
    assert chunk_roots(picked) == [chunk_root(row) for row in picked]
    assert opening_roots(rows[:0]) == []


def test_plaintext_values_are_committed_row_by_row() -> None:
    # Prepare: encryption off, float64 values
    values = np.random.default_rng(4).normal(size=(3, 2048))
    # Execute / Assert
    assert chunk_roots(values) == [chunk_root(row) for row in values]


def test_rows_that_are_not_ciphertexts_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        opening_roots(np.zeros((2, 100), dtype=np.uint64))  # 2N not a multiple of 2K
    with pytest.raises(InvalidArgumentError):
        opening_roots(np.zeros(4096, dtype=np.uint64))  # one row, not a batch
