"""Tests for crypto.noise_pool: DP noise drawn ahead by a low-priority thread, each value
handed out once, bounded, dropped when the noise changes, never drawn ahead from a seed."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from crypto.noise_pool import NoiseDraw, NoisePool
from crypto.randomness import SecureRandom, SeededRandom

N = 200_000
WAIT_S = 60.0  # a bound on waiting for the thread, never a measurement
SMALL = NoiseDraw(0.5, (10, 10), np.float64)


@pytest.fixture
def pool() -> Iterator[NoisePool]:
    pool = NoisePool(SecureRandom())
    yield pool
    pool.close()


def _filled(pool: NoisePool, draws: list[NoiseDraw]) -> NoisePool:
    """``pool`` once its thread has drawn ``draws``."""
    pool.fill(draws)
    assert pool.wait(WAIT_S)
    return pool


def _noise_threads(besides: frozenset[threading.Thread] = frozenset()) -> set[threading.Thread]:
    """The pools' threads alive now, less ``besides`` (other tests' pools, still alive)."""
    return {t for t in threading.enumerate() if t.name == "fedps-noise-ahead"} - besides


@pytest.fixture
def others() -> frozenset[threading.Thread]:
    """The noise threads alive before the test."""
    return frozenset(_noise_threads())


def _moments(x: np.ndarray) -> tuple[float, float, float]:
    """Mean, standard deviation and excess kurtosis."""
    mean = float(x.mean())
    std = float(x.std())
    kurtosis = float(np.mean(((x - mean) / std) ** 4) - 3.0)
    return mean, std, kurtosis


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooled_noise_has_the_requested_distribution(
    pool: NoisePool, dtype: type[np.float32] | type[np.float64]
) -> None:
    # Prepare: one array larger than the thread's pieces, drawn ahead
    draw = NoiseDraw(2.5, (N // 100, 100), dtype)
    _filled(pool, [draw])

    # Execute
    x = pool.normal(2.5, (N // 100, 100), dtype=dtype)

    # Assert: taken from the pool; shape, dtype, mean 0, std 2.5, Gaussian tails (5 standard
    # errors each), no value twice (no piece repeats another's keystream)
    assert (pool.taken, pool.drawn) == (1, 0)
    assert x.shape == (N // 100, 100) and x.dtype == np.dtype(dtype)
    mean, std, kurtosis = _moments(x.ravel().astype(np.float64))
    assert abs(mean) < 5 * 2.5 / np.sqrt(N)
    assert abs(std / 2.5 - 1) < 5 / np.sqrt(2 * N)
    assert abs(kurtosis) < 5 * np.sqrt(24 / N)
    if dtype is np.float64:
        assert np.unique(x).size == N


def test_each_array_is_handed_out_once_and_kept_by_no_one(pool: NoisePool) -> None:
    # Prepare: three arrays of one draw ready
    _filled(pool, [SMALL] * 3)
    assert pool.ready(SMALL) == 3

    # Execute: five asked for
    taken = [pool.normal(SMALL.std, SMALL.shape) for _ in range(5)]
    last = weakref.ref(taken[-1])

    # Assert: three from the pool, two drawn on demand, no value twice; the pool is empty
    # and keeps no reference to what it handed out
    assert (pool.taken, pool.drawn) == (3, 2)
    values = np.concatenate([x.ravel() for x in taken])
    assert np.unique(values).size == values.size
    assert pool.ready(SMALL) == 0 and pool.reserved_bytes == 0
    del taken
    gc.collect()
    assert last() is None


def test_another_std_shape_or_dtype_is_drawn_on_demand_and_drops_the_pool(
    pool: NoisePool,
) -> None:
    # Prepare
    _filled(pool, [SMALL] * 2)

    # Execute: the same shape and dtype at another std; then another shape; another dtype
    other_std = pool.normal(1.0, SMALL.shape)
    dropped = pool.ready(SMALL)
    _filled(pool, [SMALL] * 2)
    other_shape = pool.normal(SMALL.std, (5, 20))
    _filled(pool, [SMALL] * 2)
    other_dtype = pool.normal(SMALL.std, SMALL.shape, dtype=np.float32)

    # Assert: each drawn on demand as asked, and each dropped what was drawn for the old noise
    assert (pool.taken, pool.drawn) == (0, 3)
    assert dropped == 0 and pool.ready(SMALL) == 0 and pool.reserved_bytes == 0
    assert other_std.shape == SMALL.shape and other_shape.shape == (5, 20)
    assert other_dtype.dtype == np.float32


def test_an_empty_pool_draws_on_demand(
    pool: NoisePool, others: frozenset[threading.Thread]
) -> None:
    # Execute
    x = pool.normal(SMALL.std, SMALL.shape, dtype=np.float32)

    # Assert
    assert (pool.taken, pool.drawn) == (0, 1)
    assert x.shape == SMALL.shape and x.dtype == np.float32
    assert not _noise_threads(others)  # nothing planned: no thread


def test_a_new_plan_for_other_noise_drops_the_pool(pool: NoisePool) -> None:
    # Prepare
    other = NoiseDraw(0.25, (7,), np.float32)
    _filled(pool, [SMALL] * 2)

    # Execute
    _filled(pool, [other])

    # Assert
    assert pool.ready(SMALL) == 0 and pool.ready(other) == 1
    assert pool.reserved_bytes == other.nbytes


def test_the_same_plan_again_draws_only_what_is_missing(pool: NoisePool) -> None:
    # Prepare: one array of three used
    _filled(pool, [SMALL] * 3)
    pool.normal(SMALL.std, SMALL.shape)

    # Execute
    _filled(pool, [SMALL] * 3)

    # Assert
    assert pool.ready(SMALL) == 3 and pool.reserved_bytes == 3 * SMALL.nbytes


def test_the_pool_is_bounded() -> None:
    # Prepare: room for three arrays and a bit
    pool = NoisePool(SecureRandom(), max_bytes=3 * SMALL.nbytes + 10)

    # Execute: ten planned
    _filled(pool, [SMALL] * 10)
    ready = pool.ready(SMALL)
    reserved = pool.reserved_bytes
    taken = [pool.normal(SMALL.std, SMALL.shape) for _ in range(10)]
    pool.close()

    # Assert: three drawn ahead, the rest on demand
    assert ready == 3 and reserved == 3 * SMALL.nbytes <= pool.max_bytes
    assert (pool.taken, pool.drawn) == (3, 7)
    assert len(taken) == 10


class _Gated(SecureRandom):
    """A CSPRNG whose draws on the pool's thread each take a permit, waiting for one."""

    def __init__(self, permits: int) -> None:
        self.permits = threading.Semaphore(permits)
        self.waiting = threading.Event()  # a draw is waiting for a permit

    def normal(
        self,
        std: float,
        shape: int | tuple[int, ...],
        *,
        dtype: type[np.float32] | type[np.float64] = np.float64,
    ) -> np.ndarray:
        if threading.current_thread().name == "fedps-noise-ahead" and not self.permits.acquire(
            blocking=False
        ):
            self.waiting.set()
            self.permits.acquire()
        return super().normal(std, shape, dtype=dtype)


def test_stop_keeps_what_is_ready_and_abandons_the_rest() -> None:
    # Prepare: a pool whose thread draws one array of three, then waits in the second
    source = _Gated(1)
    pool = NoisePool(source)
    pool.fill([SMALL] * 3)
    assert source.waiting.wait(WAIT_S)

    # Execute: training starts; the second draw is let go
    pool.stop()
    source.permits.release()
    done = pool.wait(WAIT_S)

    # Assert: the first array is kept, the second dropped, the third never drawn
    assert done and pool.ready(SMALL) == 1
    assert pool.reserved_bytes == SMALL.nbytes
    pool.close()


def test_the_same_plan_while_drawing_counts_the_draw_in_progress() -> None:
    # Prepare: one array of three ready, the second being drawn
    source = _Gated(1)
    pool = NoisePool(source)
    pool.fill([SMALL] * 3)
    assert source.waiting.wait(WAIT_S)

    # Execute: the plan again, then the draws let go
    pool.fill([SMALL] * 3)
    reserved = pool.reserved_bytes
    for _ in range(3):
        source.permits.release()
    done = pool.wait(WAIT_S)

    # Assert: three arrays, not four
    assert reserved == 3 * SMALL.nbytes
    assert done and pool.ready(SMALL) == 3
    pool.close()


def test_close_ends_the_thread_and_drops_the_pool(
    pool: NoisePool, others: frozenset[threading.Thread]
) -> None:
    # Prepare
    _filled(pool, [SMALL] * 2)
    assert len(_noise_threads(others)) == 1

    # Execute
    pool.close()

    # Assert: no thread left, nothing held; a later fill starts a thread again
    assert not _noise_threads(others)
    assert pool.ready(SMALL) == 0 and pool.reserved_bytes == 0
    _filled(pool, [SMALL])
    assert pool.ready(SMALL) == 1
    pool.close()
    assert not _noise_threads(others)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread nice")
def test_the_thread_runs_at_the_lowest_priority(
    pool: NoisePool, others: frozenset[threading.Thread]
) -> None:
    # Execute
    _filled(pool, [SMALL])
    (thread,) = _noise_threads(others)

    # Assert: the thread alone, not the process
    assert thread.native_id is not None
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19


def test_a_seeded_source_is_never_drawn_ahead_and_stays_reproducible(
    others: frozenset[threading.Thread],
) -> None:
    # Prepare
    pool = NoisePool(SeededRandom(5))
    reference = SeededRandom(5)

    # Execute
    pool.fill([SMALL] * 3)
    drawn = [pool.normal(SMALL.std, SMALL.shape) for _ in range(3)]

    # Assert: no thread, nothing pooled; the seeded sequence as drawn on demand
    assert pool.max_bytes == 0 and not _noise_threads(others) and pool.ready(SMALL) == 0
    assert (pool.taken, pool.drawn) == (0, 3)
    for x in drawn:
        np.testing.assert_array_equal(x, reference.normal(SMALL.std, SMALL.shape))
