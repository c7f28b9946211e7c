"""Tests for the batched RLWE encryption of zero: exact products, distributions, SEAL decrypts."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import CkksParams, SecretContext
from crypto.ckks_encoder import CkksEncoder
from crypto.rlwe import RingProduct, ZeroEncryptor, cbd21, supported, ternary, uniform
from fedps.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def keys() -> SecretContext:
    return SecretContext.generate(CkksParams())


def _negacyclic(a: np.ndarray, u: np.ndarray, q: int) -> np.ndarray:
    """Schoolbook a * u mod (X^N + 1, q) in exact int64 (u ternary, N * max|a| < 2^63)."""
    n = a.size
    full = np.convolve(a.astype(np.int64), u.astype(np.int64))
    out = full[:n].copy()
    out[: n - 1] -= full[n:]
    result: np.ndarray = out % q
    return result


@pytest.mark.parametrize(
    "params",
    [CkksParams(), CkksParams(poly_modulus_degree=4096, coeff_modulus_bits=49, scale_bits=30)],
    ids=["default", "n4096-q49"],
)
def test_products_equal_exact_negacyclic_products(params: CkksParams) -> None:
    # Prepare: a real public key (the defaults, and the largest q the bulk path takes at
    # N = 4096: N * q just below 2^62) and three ternary polynomials
    public = SecretContext.generate(params).public
    zeros = ZeroEncryptor(public.public_key_coefficients, public.modulus)
    u = ternary(3, zeros.n)
    # Execute
    products = zeros.products(u) % public.modulus
    # Assert: equal to the schoolbook products, coefficient for coefficient
    key = public.public_key_coefficients.astype(np.int64)
    for i in range(3):
        for poly in range(2):
            expected = _negacyclic(key[poly], u[i], public.modulus)
            np.testing.assert_array_equal(products[i, poly], expected)


def test_ternary_and_binomial_samples_have_the_right_distribution() -> None:
    u = ternary(50, 2048)
    e = cbd21((100_000,))
    # ternary: only -1, 0, 1, each about a third
    assert set(np.unique(u).tolist()) == {-1.0, 0.0, 1.0}
    for value in (-1.0, 0.0, 1.0):
        assert abs(float(np.mean(u == value)) - 1 / 3) < 0.01
    # centred binomial of 21 + 21 bits: within +-21, mean 0, variance 21/2
    assert int(e.min()) >= -21 and int(e.max()) <= 21
    assert abs(float(e.mean())) < 0.05
    assert abs(float(e.var()) - 10.5) < 0.3


def test_encryptions_of_zero_decrypt_with_seal_and_are_fresh(keys: SecretContext) -> None:
    # Prepare: two draws of zeros, values encoded and added to the first one
    public = keys.public
    n = public.params.poly_modulus_degree
    first, second = public.encrypt_zeros(4), public.encrypt_zeros(4)
    values = np.random.default_rng(3).uniform(-1, 1, (4, public.params.values_per_block))
    plain = CkksEncoder(public.params, public.modulus).encode(values)
    cipher = first.copy()
    cipher[:, :n] = (cipher[:, :n] + plain) % np.uint64(public.modulus)
    # Execute
    decrypted = [keys.decrypt(cipher[i]) for i in range(4)]
    # Assert: the decryption recovers the values; no two zeros share randomness
    for i in range(4):
        assert np.abs(decrypted[i] - values[i]).max() < 1e-4
    assert first.max() < public.modulus
    rows = {row.tobytes() for row in np.concatenate([first, second])}
    assert len(rows) == 8


def test_parameters_beyond_the_exact_range_use_seal_per_ciphertext() -> None:
    # Prepare: N = 4096 with a 60-bit q: N * q >= 2^62, the int64 recombination could overflow
    keys = SecretContext.generate(
        CkksParams(poly_modulus_degree=4096, coeff_modulus_bits=60, scale_bits=40)
    )
    public = keys.public
    n = public.params.poly_modulus_degree
    assert not supported(n, public.modulus)
    with pytest.raises(InvalidArgumentError, match="2\\^62"):
        ZeroEncryptor(public.public_key_coefficients, public.modulus)
    # Execute: encryption still works, through SEAL
    zeros = public.encrypt_zeros(2)
    values = np.linspace(-1, 1, public.params.values_per_block)
    plain = CkksEncoder(public.params, public.modulus).encode(values[None, :])
    zeros[0, :n] = (zeros[0, :n] + plain[0]) % np.uint64(public.modulus)
    # Assert
    assert np.abs(keys.decrypt(zeros[0]) - values).max() < 1e-4


def test_zero_encryptor_rejects_a_malformed_key() -> None:
    with pytest.raises(InvalidArgumentError, match="shape"):
        ZeroEncryptor(np.zeros((3, 8), dtype=np.uint64), 97)
    with pytest.raises(InvalidArgumentError, match="below the modulus"):
        ZeroEncryptor(np.full((2, 8), 97, dtype=np.uint64), 97)
    with pytest.raises(InvalidArgumentError, match="2\\^62"):
        ZeroEncryptor(np.zeros((2, 2048), dtype=np.uint64), (1 << 52) - 1)


@pytest.mark.parametrize("n", [64, 2048])
def test_ring_products_of_full_size_polynomials_are_exact(keys: SecretContext, n: int) -> None:
    # Prepare: the default prime, polynomials uniform modulo q (a threshold key share's kind)
    q = keys.public.modulus
    fixed, polys = uniform(1, n, q)[0], uniform(2, n, q)
    # Execute
    got = RingProduct(fixed, q).times(polys)
    # Assert: equal to the schoolbook product in Python integers
    for poly, product in zip(polys, got, strict=True):
        full = np.convolve(poly.astype(object), fixed.astype(object))
        exact = full[:n].copy()
        exact[: n - 1] -= full[n:]
        assert product.tolist() == [int(v) % q for v in exact]
    with pytest.raises(InvalidArgumentError):
        RingProduct(np.full(n, q, dtype=np.uint64), q)


def test_uniform_coefficients_are_below_the_modulus_and_spread() -> None:
    # Prepare
    q = (1 << 45) + 1
    # Execute
    draws = uniform(3, 2048, q)
    # Assert: below q, about half below q / 2 (std of the fraction 0.0064: a band of 9)
    assert draws.shape == (3, 2048) and draws.dtype == np.uint64
    assert int(draws.max()) < q
    assert 0.44 < float(np.mean(draws < q // 2)) < 0.56
