"""Tests for crypto.randomness: the CSPRNG's draws, the hardened Gaussian, the seeded mode."""

from __future__ import annotations

import logging
import multiprocessing

import numpy as np
import pytest

from crypto.randomness import RandomSource, SecureRandom, SeededRandom, random_source

N = 200_000


def _moments(x: np.ndarray) -> tuple[float, float, float]:
    """Mean, standard deviation and excess kurtosis."""
    mean = float(x.mean())
    std = float(x.std())
    kurtosis = float(np.mean(((x - mean) / std) ** 4) - 3.0)
    return mean, std, kurtosis


@pytest.mark.parametrize("source", [SecureRandom(), SeededRandom(7)], ids=["secure", "seeded"])
def test_normal_has_the_requested_distribution(source: RandomSource) -> None:
    # Execute
    x = source.normal(2.5, (N // 100, 100))

    # Assert: shape, mean 0, std 2.5, Gaussian tails (5 standard errors each)
    assert x.shape == (N // 100, 100)
    mean, std, kurtosis = _moments(x.ravel())
    assert abs(mean) < 5 * 2.5 / np.sqrt(N)
    assert abs(std / 2.5 - 1) < 5 / np.sqrt(2 * N)
    assert abs(kurtosis) < 5 * np.sqrt(24 / N)


def test_uniform_bernoulli_and_sample() -> None:
    # Prepare
    source = SecureRandom()

    # Execute
    u = source.uniform(N)
    mask = source.bernoulli(N, 0.3)
    picked = [source.sample([str(i) for i in range(10)], 3) for _ in range(3000)]

    # Assert
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / N)
    assert abs(mask.mean() - 0.3) < 5 * np.sqrt(0.3 * 0.7 / N)
    assert all(len(set(p)) == 3 for p in picked)
    counts = np.bincount([int(i) for p in picked for i in p], minlength=10)
    assert np.all(np.abs(counts - 900) < 5 * np.sqrt(900))  # each item at rate 3/10
    with pytest.raises(ValueError, match="rate"):
        source.bernoulli(3, 1.5)


def test_secure_draws_never_repeat_even_across_a_fork() -> None:
    # Prepare
    source = SecureRandom()
    context = multiprocessing.get_context("fork")

    # Execute: the same source in this process and in a forked child
    with context.Pool(1) as pool:
        child = pool.apply(source.normal, (1.0, 64))
    here = source.normal(1.0, 64)

    # Assert
    assert not np.array_equal(child, here)
    assert not np.array_equal(source.normal(1.0, 64), source.normal(1.0, 64))


def test_seeded_draws_repeat_and_warn(caplog: pytest.LogCaptureFixture) -> None:
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        a = random_source(11, role="client")
    b = random_source(11, role="client")
    secure = random_source(None, role="client")

    # Assert
    assert isinstance(a, SeededRandom) and not a.secure
    assert np.array_equal(a.normal(1.0, 32), b.normal(1.0, 32))
    assert "insecure_reproducible" in caplog.text
    assert isinstance(secure, SecureRandom) and secure.secure
