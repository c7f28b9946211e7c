"""Tests for crypto.seal_ring_product: SEAL's products equal numpy's exact ones."""

from __future__ import annotations

import numpy as np
import pytest

from crypto.rlwe import RingProduct, uniform
from crypto.seal_ring_product import SealRingProduct
from fedps.errors import InvalidArgumentError
from tests.crypto.threshold_keys import Joint, N, generate


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(1)


@pytest.mark.parametrize("count", [0, 1, 14, 15, 16, 31])
def test_products_equal_the_exact_ring_products(joint: Joint, count: int) -> None:
    # Prepare: a fixed factor uniform modulo q (a weighted share), batches around 15 a ciphertext
    q = joint.modulus
    fixed = uniform(1, N, q)[0]
    polys = uniform(count, N, q)
    # Execute
    got = SealRingProduct(joint.public, fixed).times(polys)
    # Assert: exactly numpy's product modulo (X^N + 1, q)
    assert got.dtype == np.uint64 and got.shape == (count, N)
    assert np.array_equal(got, RingProduct(fixed, q).times(polys))


def test_products_of_zeros_and_by_zero(joint: Joint) -> None:
    # Prepare: zero polynomials (a ciphertext SEAL calls transparent) and a zero factor
    q = joint.modulus
    zeros = np.zeros((3, N), dtype=np.uint64)
    # Execute / Assert
    assert not SealRingProduct(joint.public, uniform(1, N, q)[0]).times(zeros).any()
    by_zero = SealRingProduct(joint.public, np.zeros(N, dtype=np.uint64))
    assert not by_zero.times(uniform(2, N, q)).any()


def test_products_refuse_what_is_not_below_q(joint: Joint) -> None:
    q = joint.modulus
    with pytest.raises(InvalidArgumentError):
        SealRingProduct(joint.public, np.full(N, q, dtype=np.uint64))
    product = SealRingProduct(joint.public, uniform(1, N, q)[0])
    with pytest.raises(InvalidArgumentError):
        product.times(np.full((1, N), q, dtype=np.uint64))
    with pytest.raises(InvalidArgumentError):
        product.times(np.zeros((1, N // 2), dtype=np.uint64))
