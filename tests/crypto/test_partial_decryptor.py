"""Tests for crypto.partial_decryptor: a party's fast partials are the reference partials."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import threshold as th
from crypto.noise_pool import NoisePool
from crypto.params import TAIL_SIGMAS
from crypto.partial_decryptor import PartialDecryptor
from crypto.randomness import SecureRandom
from fedps.errors import InvalidArgumentError
from tests.crypto.threshold_keys import Joint, N, generate
from tests.crypto.threshold_keys import aggregate as encrypted_sum

WAIT_S = 60.0


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(3)


def test_unflooded_partials_equal_the_reference_and_decrypt(joint: Joint) -> None:
    # Prepare: a 2-of-3 dealing and a real aggregate of 3 clients over 17 blocks (2 ciphertexts)
    shares = joint.shares(2)
    rows, _ = encrypted_sum(joint.public, 3, 17)
    decryptors = {j: PartialDecryptor(shares[j - 1], joint.public) for j in (1, 3)}
    # Execute: both participants, without flooding
    partials = [d.decrypt(rows[:, N:], participants=[1, 3], sigma=0.0) for d in decryptors.values()]
    # Assert: exactly the reference partials, and together the single-key decryption
    for (j, _), partial in zip(decryptors.items(), partials, strict=True):
        reference = th.partial_decryption(shares[j - 1], rows[:, N:], participants=[1, 3], sigma=0)
        assert np.array_equal(partial, reference)
    plain = th.combine(rows[:, :N], partials, joint.modulus)
    assert np.array_equal(plain, joint.exact(rows))
    for decryptor in decryptors.values():
        decryptor.close()


def test_the_flooding_is_drawn_ahead_once_and_never_reused(joint: Joint) -> None:
    # Prepare: a party whose pool the test watches
    share = joint.shares(2)[0]
    rows, _ = encrypted_sum(joint.public, 2, 2)
    pool = NoisePool(SecureRandom())
    decryptor = PartialDecryptor(share, joint.public, noise=pool)
    sigma = 2.0**30
    exact = th.partial_decryption(share, rows[:, N:], participants=[1, 2], sigma=0)
    # Execute: two rounds, the second after the pool drew its flooding
    first = decryptor.decrypt(rows[:, N:], participants=[1, 2], sigma=sigma)
    assert pool.wait(WAIT_S)
    second = decryptor.decrypt(rows[:, N:], participants=[1, 2], sigma=sigma)
    # Assert: the first drawn then, the second from the pool; each within its tail bound
    assert (pool.drawn, pool.taken) == (1, 1)
    q = joint.modulus
    bound = TAIL_SIGMAS * sigma + 1
    for partial in (first, second):
        error = (partial.astype(np.int64) - exact.astype(np.int64)) % q
        centred = np.where(error > q // 2, error - q, error)
        assert np.abs(centred).max() <= bound
        assert np.abs(centred).std() > sigma / 2  # flooded
    assert not np.array_equal(first, second)  # fresh noise each round
    decryptor.close()


def test_partials_refuse_a_wrong_set_of_participants_or_std(joint: Joint) -> None:
    share = joint.shares(2)[0]
    decryptor = PartialDecryptor(share, joint.public)
    c1 = np.zeros((1, N), dtype=np.uint64)
    for participants in ([2, 3], [1], [1, 2, 3], [1, 4]):
        with pytest.raises(InvalidArgumentError):
            decryptor.decrypt(c1, participants=participants, sigma=1.0)
    for sigma in (-1.0, float("nan")):
        with pytest.raises(InvalidArgumentError):
            decryptor.decrypt(c1, participants=[1, 2], sigma=sigma)
    decryptor.close()
