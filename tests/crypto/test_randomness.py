"""Tests for crypto.randomness: the CSPRNG's draws, the hardened Gaussian, the seeded mode."""

from __future__ import annotations

import logging
import multiprocessing
import sys

import numpy as np
import pytest

from crypto import randomness
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


def _words(seed: int, count: int) -> np.ndarray:
    """The first ``count`` words of ``SeededRandom(seed)``'s stream: PCG64's raw output."""
    words: np.ndarray = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw(count)
    return words


def _four_gaussians(words: np.ndarray, chunk: int, std: float) -> np.ndarray:
    """The reference of the hardened Gaussian, written out.

    Per chunk of ``chunk`` values, four standard Gaussians per value (both outputs of two
    Box-Muller pairs, angles measured from -pi/4), summed and divided by 2, times ``std``.
    """
    values = []
    for block in words.reshape(-1, 4 * chunk):
        u = (block >> np.uint64(11)).astype(np.float64) / 2.0**53
        radius = np.sqrt(-2.0 * np.log1p(-u[: 2 * chunk]))
        theta = 2.0 * np.pi * u[2 * chunk :] - np.pi / 4
        z = [radius[:chunk] * np.cos(theta[:chunk]), radius[:chunk] * np.sin(theta[:chunk])]
        z += [radius[chunk:] * np.cos(theta[chunk:]), radius[chunk:] * np.sin(theta[chunk:])]
        values.append((z[0] + z[1] + z[2] + z[3]) / 2 * std)
    return np.concatenate(values)


@pytest.fixture(params=["torch", "numpy"])
def vector_math(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the transform on torch's float64 math (a client) or numpy's (no torch imported)."""
    if request.param == "torch":
        pytest.importorskip("torch")
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    return str(request.param)


@pytest.mark.parametrize("count", [1, 7, 23, 40])
def test_each_value_is_half_the_sum_of_four_box_muller_gaussians(
    count: int, vector_math: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: chunks of at most 8 values, so 23 and 40 values cross chunk boundaries
    monkeypatch.setattr(randomness, "_CHUNK", 8)
    chunks = -(-count // 8)
    chunk = -(-count // chunks)

    # Execute
    x = SeededRandom(3).normal(1.5, count)

    # Assert: the floating-point mitigation, value by value, from the same words; the last
    # chunk's surplus values are discarded, and torch stays out of a process without it
    expected = _four_gaussians(_words(3, 4 * chunk * chunks), chunk, 1.5)[:count]
    np.testing.assert_allclose(x, expected, rtol=0, atol=1e-12)
    assert ("torch" in sys.modules) == (vector_math == "torch")


def test_float32_noise_is_the_float64_value_rounded_once() -> None:
    # Execute
    wide = SeededRandom(5).normal(0.7, (3, 1000))
    narrow = SeededRandom(5).normal(0.7, (3, 1000), dtype=np.float32)

    # Assert
    assert narrow.dtype == np.float32 and narrow.shape == (3, 1000)
    assert np.array_equal(narrow, wide.astype(np.float32))


@pytest.mark.parametrize("source", [SecureRandom(), SeededRandom(9)], ids=["secure", "seeded"])
def test_shapes_zero_std_and_refusals(source: RandomSource) -> None:
    # Execute / Assert: shapes and dtypes, whatever the count
    assert source.normal(1.0, 5).shape == (5,)
    assert source.normal(1.0, (2, 0, 3)).shape == (2, 0, 3)
    assert source.normal(1.0, ()).shape == ()
    assert source.normal(1.0, (4, 2), dtype=np.float32).dtype == np.float32
    # std = 0: exact zeros, no draw
    zeros = source.normal(0.0, (3, 4), dtype=np.float32)
    assert zeros.dtype == np.float32 and not zeros.any() and zeros.shape == (3, 4)
    for std in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="std"):
            source.normal(std, 3)
    with pytest.raises(ValueError, match="float32 or float64"):
        source.normal(1.0, 3, dtype=np.float16)  # type: ignore[arg-type]


def test_a_large_draw_in_chunks_is_independent_and_never_repeats() -> None:
    # Prepare: more values than three chunks, a partial chunk at the end
    count = 3 * randomness._CHUNK + 5

    # Execute
    x = SecureRandom().normal(1.0, count)

    # Assert: no value twice (no chunk restarts the keystream), no correlation between
    # neighbours or across a chunk, and the right spread
    assert np.unique(x).size == count
    for lag in (1, randomness._CHUNK // 2, randomness._CHUNK):
        corr = float(np.corrcoef(x[:-lag], x[lag:])[0, 1])
        assert abs(corr) < 5 / np.sqrt(count - lag)
    assert abs(float(x.std()) - 1) < 5 / np.sqrt(2 * count)
