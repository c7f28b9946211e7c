"""Tests for threshold CKKS: collective keys SEAL accepts, T-of-P decryption, noise below T.

Every bound here is a proven tail, never a timing: a flooded coefficient is a sum of ``T``
rounded Gaussians of std ``sigma``, checked at 13 ``sqrt(T) sigma`` (plus the rounding), and
an aggregate's own error at :func:`crypto.threshold.joint_value_bound` (both exceeded with
probability below 2^-120 per coefficient). Statistical checks of noise use fixed fractions
with margins of 9 standard deviations or more.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from crypto import threshold as th
from crypto.ckks_encoder import CkksEncoder
from crypto.params import TAIL_SIGMAS
from fedps.errors import FedPSError, InvalidArgumentError
from tests.crypto.threshold_keys import PARAMS, SEED, Joint, N, generate
from tests.crypto.threshold_keys import aggregate as encrypted_sum

PARTIES = 3
CLIENTS = 5
LAMBDA = 16


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(PARTIES)


@pytest.fixture(scope="module")
def aggregate(joint: Joint) -> tuple[np.ndarray, np.ndarray]:
    """Two blocks summed over :data:`CLIENTS` clients' real ciphertexts, and the plain sum."""
    return encrypted_sum(joint.public, CLIENTS, 2)


def _decrypt(
    shares: list[th.KeyShare], rows: np.ndarray, participants: list[int], sigma: float
) -> np.ndarray:
    """The combiner's plaintexts from the partials of ``participants``."""
    partials = [
        th.partial_decryption(shares[j - 1], rows[:, N:], participants=participants, sigma=sigma)
        for j in participants
    ]
    return th.combine(rows[:, :N], partials, shares[0].modulus)


def _noise_like(plain: np.ndarray, modulus: int) -> None:
    """``plain`` (centred) looks uniform modulo q: about half its coefficients above q/4.

    A decryption of a sum of :data:`CLIENTS` values of at most 1 stays below
    ``CLIENTS * scale`` (2^39.3), far below q/4 (2^44); uniform coefficients exceed q/4 with
    probability 1/2, and over 4,096 of them the fraction's std is 0.008: the band is 10 of it.
    """
    fraction = float(np.mean(np.abs(plain) > modulus // 4))
    assert 0.42 < fraction < 0.58
    assert np.abs(plain).max() > modulus // 4


# --------------------------------------------------------------------------- key generation


def test_common_polynomial_is_the_seeds_alone() -> None:
    # Prepare
    q = (1 << 45) + 1  # any modulus: the expansion does not need a prime
    # Execute
    first, again = (th.common_polynomial(b"s" * 16, N, q) for _ in range(2))
    other = th.common_polynomial(b"t" * 16, N, q)
    # Assert: every party derives the same a; another seed another one; uniform below q
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first.dtype == np.uint64 and int(first.max()) < q
    assert 0.45 < float(np.mean(first < q // 2)) < 0.55
    with pytest.raises(InvalidArgumentError):
        th.common_polynomial(b"short", N, q)


def test_joint_key_is_a_seal_public_key_of_the_summed_secret(joint: Joint) -> None:
    # Prepare: SEAL's own public-key encryptor under the loaded joint key, and fedps's bulk one
    public = joint.public
    bound = th.joint_value_bound(PARAMS, 1, PARTIES)
    # Execute
    by_seal = public._encrypt_zeros_with_seal(4)
    by_numpy = public.encrypt_zeros(4)
    # Assert: both decrypt to zero under s = sum s_i, within one ciphertext's error bound
    for zeros in (by_seal, by_numpy):
        assert np.abs(joint.exact(zeros)).max() <= bound
    assert (
        public.public_key_coefficients[1].tolist()
        == th.common_polynomial(SEED, N, joint.modulus).tolist()
    )


def test_joint_key_refuses_coefficients_outside_the_ring(joint: Joint) -> None:
    # Prepare
    bad = joint.public.public_key_coefficients.copy()
    bad[0, 5] = joint.modulus
    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        th.joint_public_context(PARAMS, bad)
    with pytest.raises(InvalidArgumentError):
        th.joint_public_key(bad[1], [bad[0]], joint.modulus)


# --------------------------------------------------------------------------- decryption


@pytest.mark.parametrize("threshold", [PARTIES, 2], ids=["3-of-3", "2-of-3"])
def test_joint_decryption_equals_single_key_decryption(
    joint: Joint, aggregate: tuple[np.ndarray, np.ndarray], threshold: int
) -> None:
    # Prepare
    rows, plain_sum = aggregate
    shares = joint.shares(threshold)
    sigma = th.flooding_std(PARAMS, CLIENTS, parties=PARTIES, lambda_bits=LAMBDA)
    exact = joint.exact(rows)
    flood_bound = TAIL_SIGMAS * math.sqrt(threshold) * sigma + threshold  # + rounding
    encoder = CkksEncoder(PARAMS, joint.modulus)
    for participants in itertools.combinations(range(1, PARTIES + 1), threshold):
        # Execute
        plain = _decrypt(shares, rows, list(participants), sigma)
        # Assert: the single-key decryption plus the parties' flooding, and nothing else
        difference = plain - exact
        assert np.abs(difference).max() <= flood_bound
        assert abs(float(difference.std()) / (math.sqrt(threshold) * sigma) - 1) < 0.15
        error = th.joint_value_bound(PARAMS, CLIENTS, PARTIES) + flood_bound
        assert np.abs(encoder.decode(plain) - plain_sum).max() <= error / PARAMS.scale


def test_fewer_than_threshold_partials_decrypt_nothing(
    joint: Joint, aggregate: tuple[np.ndarray, np.ndarray]
) -> None:
    # Prepare: 2-of-3; one party's partial for a set whose other member never answers
    rows, _ = aggregate
    shares = joint.shares(2)
    sigma = th.flooding_std(PARAMS, CLIENTS, parties=PARTIES, lambda_bits=LAMBDA)
    for j, k in itertools.permutations(range(1, PARTIES + 1), 2):
        # Execute
        alone = _decrypt(shares, rows, [j, k], sigma)  # both answer: the control
        partial = th.partial_decryption(shares[j - 1], rows[:, N:], participants=[j, k], sigma=0)
        # Assert
        assert np.abs(alone - joint.exact(rows)).max() <= 13 * math.sqrt(2) * sigma + 2
        _noise_like(th.combine(rows[:, :N], [partial], joint.modulus), joint.modulus)
    # a share alone is uniform modulo q, and asks for T parties
    _noise_like(shares[0].share.astype(np.int64) - joint.modulus // 2, joint.modulus)
    with pytest.raises(InvalidArgumentError):
        th.partial_decryption(shares[0], rows[:, N:], participants=[1], sigma=sigma)


def test_p_of_p_with_one_party_missing_decrypts_nothing(
    joint: Joint, aggregate: tuple[np.ndarray, np.ndarray]
) -> None:
    # Prepare
    rows, _ = aggregate
    shares = joint.shares(PARTIES)
    everyone = list(range(1, PARTIES + 1))
    for missing in everyone:
        present = [j for j in everyone if j != missing]
        # Execute
        partials = [
            th.partial_decryption(shares[j - 1], rows[:, N:], participants=everyone, sigma=0)
            for j in present
        ]
        # Assert
        _noise_like(th.combine(rows[:, :N], partials, joint.modulus), joint.modulus)
        with pytest.raises(InvalidArgumentError):  # nor can the rest decrypt as a set
            th.partial_decryption(
                shares[present[0] - 1], rows[:, N:], participants=present, sigma=0
            )


def test_partial_decryption_refuses_what_is_not_its_round(joint: Joint) -> None:
    # Prepare
    share = joint.shares(2)[0]
    c1 = np.zeros((1, N), dtype=np.uint64)
    # Execute / Assert: not among the participants, an index beyond P, a coefficient >= q
    for participants in ([2, 3], [1, 4], [1, 1]):
        with pytest.raises(InvalidArgumentError):
            th.partial_decryption(share, c1, participants=participants, sigma=1.0)
    c1[0, 0] = joint.modulus
    with pytest.raises(InvalidArgumentError):
        th.partial_decryption(share, c1, participants=[1, 2], sigma=1.0)


def test_lagrange_coefficients_interpolate_at_zero() -> None:
    # Prepare: a random polynomial of degree 2 modulo a prime
    q = 2**61 - 1
    coefficients = [12345, 2**60 + 17, 987654321]

    def f(x: int) -> int:
        total: int = sum(c * pow(x, k, q) for k, c in enumerate(coefficients))
        return total % q

    # Execute / Assert
    for points in ([1, 2, 3], [2, 4, 5], [5, 1, 3]):
        weights = th.lagrange_coefficients(points, q)
        assert sum(weights[j] * f(j) for j in points) % q == coefficients[0]
    with pytest.raises(InvalidArgumentError):
        th.lagrange_coefficients([1, 1], q)


def test_flooding_std_follows_the_derivation() -> None:
    # Prepare: the defaults (K = 100, N = 2048, scale 2^37), three parties, lambda = 16
    bound = th.joint_value_bound(PARAMS, 100, PARTIES)
    # Execute
    sigma = th.flooding_std(PARAMS, 100, parties=PARTIES, lambda_bits=LAMBDA)
    # Assert: 2^15 times the bound; one party is the single key's bound (docs/crypto.md)
    assert sigma == 2.0**15 * bound
    assert th.joint_value_bound(PARAMS, 100, 1) == pytest.approx(
        PARAMS.error_bound(100) * PARAMS.scale
    )
    assert round(bound) == 535_979
    assert round(sigma / PARAMS.scale, 4) == 0.1278
    with pytest.raises(InvalidArgumentError):
        th.flooding_std(PARAMS, 100, parties=PARTIES, lambda_bits=0)


# --------------------------------------------------------------------------- shares at rest


@pytest.mark.usefixtures("loose_umask")
def test_shares_are_stored_0600_and_refused_when_others_can_read(
    joint: Joint, tmp_path: Path
) -> None:
    # Prepare
    share = joint.shares(2)[1]
    path = tmp_path / "share.key"
    # Execute
    share.save(path)
    loaded = th.KeyShare.load(path)
    # Assert
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (loaded.index, loaded.threshold, loaded.parties) == (2, 2, PARTIES)
    assert np.array_equal(loaded.share, share.share) and loaded.modulus == share.modulus
    assert "hidden" in repr(loaded) and str(int(share.share[0])) not in repr(loaded)
    os.chmod(path, 0o644)
    with pytest.raises(FedPSError, match="readable by group or others"):
        th.KeyShare.load(path)
    os.chmod(path, 0o600)
    data = bytearray(path.read_bytes())
    data[40] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(FedPSError, match="damaged"):
        th.KeyShare.load(path)
