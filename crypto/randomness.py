"""Randomness for privacy: DP noise, Poisson sampling, cohort sampling, flooding.

Noise protects only if nobody else can regenerate it. :class:`SecureRandom`, the default
everywhere, draws from an AES-256-CTR keystream under a fresh 256-bit key and 128-bit initial
counter block from the operating system (``os.urandom``) at every call: nothing is derived
from the configuration, two processes forked from one parent never share a stream, and
knowing every earlier output says nothing about the next. AES-CTR runs on the processor's AES
instructions through OpenSSL (``cryptography``), about twice ChaCha20's throughput there.

Floating-point Gaussian samplers leak through the low bits of their output (Mironov 2012 for
Laplace; Jin et al. 2022 and Haney et al. 2022 for Gaussians, the second against Opacus).
:meth:`RandomSource.normal` takes Opacus's ``secure_mode`` mitigation (Holohan and Braghin
2021, section 5.1, with n = 2): each value is the sum of four independent standard Gaussians
divided by 2, in float64, so recovering the noise from the output needs a search over
``2^(53 * 3)`` candidates instead of ``2^53``.

The four Gaussians are both outputs of two Box-Muller pairs, each from two 53-bit uniforms:
``z1 = r cos(t)`` and ``z2 = r sin(t)`` with ``r = sqrt(-2 ln(1 - u))`` and ``t = 2 pi v``.
The sampler computes each pair's sum in one step, ``z1 + z2 = sqrt(2) r sin(t + pi/4)``, which
is the same real number: it draws ``p = t + pi/4`` directly (uniform on the same grid of
``2^53`` angles, shifted by ``2^50`` steps) and takes one sine instead of a cosine and a sine.
The attacker's search is no smaller: every value is the same function of the same four
independent 53-bit uniforms, so explaining an output still means fixing three of them
(``2^159`` candidates) and solving for the fourth; only the rounding differs, by a few units
in the last place, as it does between two libraries' ``sin``.

The transform runs on the calling thread, in chunks that stay in the processor's cache, on
buffers allocated once per draw: keystream, 53-bit integers, doubles, then ``log``, ``sqrt``
and ``sin`` in place. ``log`` and ``sin`` are torch's vectorised float64 kernels when the
process has imported torch already (an edge client, whose DP-SGD runs on it), in pieces short
enough that torch never starts a parallel region for them, and numpy's otherwise: a shard or
key-holder install has no torch, and importing it for one draw would cost seconds and hundreds
of megabytes.

:class:`SeededRandom` is the reproducible alternative, only behind
``privacy.insecure_reproducible``: numpy's PCG64 from a seed, so anyone holding the seed
regenerates every draw. It exists for debugging and regression runs, never for privacy.
"""

from __future__ import annotations

import abc
import logging
import math
import os
import sys
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["RandomSource", "SecureRandom", "SeededRandom", "random_source"]

_log = logging.getLogger("fedps")

#: A stream of uniformly random 64-bit words: each call fills its argument (a C-contiguous
#: uint64 array) with the next words of the stream.
_Fill = Callable[[np.ndarray], None]

_GRID = 1.0 / (1 << 53)  # the spacing of the 53-bit uniforms
_ANGLE_GRID = 2.0 * math.pi * _GRID  # the spacing of the angles, 2 pi / 2^53
_CHUNK = 8192  # Gaussian values per chunk: 256 KiB of keystream and as many doubles
_ZEROS = memoryview(bytes(32 * _CHUNK))  # AES-CTR encrypts zeros into its keystream


class RandomSource(abc.ABC):
    """Uniform, Gaussian and Bernoulli draws from one source of random bits."""

    #: whether nobody else can reproduce the draws
    secure: bool

    @abc.abstractmethod
    def _stream(self) -> _Fill:
        """A stream of uniformly random 64-bit words, for one draw."""

    def _words(self, count: int) -> np.ndarray:
        """``count`` uniformly random 64-bit words."""
        words = np.empty(max(count, 0), dtype=np.uint64)
        if words.size:
            self._stream()(words)
        return words

    def uniform(self, count: int) -> np.ndarray:
        """``count`` doubles uniform in [0, 1), on the grid of multiples of 2^-53."""
        words = self._words(count)
        np.right_shift(words, np.uint64(11), out=words)
        out: np.ndarray = words.astype(np.float64)
        out *= _GRID
        return out

    def normal(
        self,
        std: float,
        shape: int | tuple[int, ...],
        *,
        dtype: type[np.float32] | type[np.float64] = np.float64,
    ) -> np.ndarray:
        """Gaussian noise N(0, std^2) of ``shape``, hardened against the floating-point attack.

        Each value is (z1 + z2 + z3 + z4) / 2 * std, computed in float64 from four independent
        standard Gaussians (both outputs of two Box-Muller pairs; see the module's notes),
        then stored as ``dtype``: float32 rounds the finished float64 value once, as adding
        it to a float32 gradient would.

        Raises
        ------
        ValueError
            When ``std`` is negative or not finite, or ``dtype`` is neither float32 nor
            float64.
        """
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"a noise std is finite and >= 0, got {std}")
        kind = np.dtype(dtype)
        if kind not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"noise is float32 or float64, got {kind}")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        out = np.zeros(dims, dtype=kind) if std == 0 else np.empty(dims, dtype=kind)
        if std > 0 and out.size:
            _hardened_normal(self._stream(), std, out.reshape(-1))
        return out

    def bernoulli(self, count: int, rate: float) -> np.ndarray:
        """``count`` independent booleans, each True with probability ``rate``."""
        if not 0 <= rate <= 1:
            raise ValueError(f"a sampling rate is in [0, 1], got {rate}")
        mask: np.ndarray = self.uniform(count) < rate
        return mask

    def sample(self, items: list[str], k: int) -> list[str]:
        """``k`` distinct items of ``items``, uniformly at random (all if there are fewer)."""
        if k >= len(items):
            return list(items)
        keys = self.uniform(len(items))
        order = np.argsort(keys, kind="stable")[:k]
        return [items[int(i)] for i in order]

    def seed(self) -> int:
        """A 63-bit seed for a helper generator (e.g. torch's, for data order)."""
        return int(self._words(1)[0] >> np.uint64(1))


def _hardened_normal(fill: _Fill, std: float, out: np.ndarray) -> None:
    """Fill the flat array ``out`` with N(0, std^2), in chunks of equal size.

    A chunk of ``k`` values takes ``4k`` words: the first ``2k`` give the pairs' radii, the
    other ``2k`` their angles, and value ``j`` sums pairs ``j`` and ``j + k``, so every word
    serves one value only. Every chunk is computed whole on the same buffers; the last one
    keeps the values ``out`` still needs (fewer than one per chunk are discarded).
    """
    chunks = -(-out.size // _CHUNK)
    k = -(-out.size // chunks)
    words = np.empty(4 * k, dtype=np.uint64)
    work = np.empty(4 * k, dtype=np.float64)
    radius, angle = work[: 2 * k], work[2 * k :]
    log, sin = _in_place(radius, np.log, "log_"), _in_place(angle, np.sin, "sin_")
    for start in range(0, out.size, k):
        fill(words)
        np.right_shift(words, np.uint64(11), out=words)  # 53-bit integers m
        np.copyto(work, words.view(np.int64))  # exact: m < 2^53 (from int64: faster)
        np.multiply(radius, -_GRID, out=radius)
        np.add(radius, 1.0, out=radius)  # 1 - u, exactly, in (0, 1]: no log(0)
        log()
        np.multiply(radius, -4.0, out=radius)
        np.sqrt(radius, out=radius)  # sqrt(2) r
        np.multiply(angle, _ANGLE_GRID, out=angle)
        sin()
        pair_sums = np.multiply(angle, radius, out=angle)  # z1 + z2 of each pair
        total = np.add(pair_sums[:k], pair_sums[k:], out=pair_sums[:k])
        end = min(start + k, out.size)
        np.multiply(total[: end - start], std / 2.0, out=out[start:end])


#: The longest piece torch's ``log`` and ``sin`` get when torch has several threads. torch runs
#: short tensors on the calling thread and longer ones in a parallel region, whose start and
#: barrier cost up to a hundred times the work itself when the cores are busy (measured on 2
#: shared cores); torch 2.13 parallelises float64 ``sin`` from somewhere between 1,536 and
#: 2,000 values. Were that limit to fall below this piece, the draw would only slow down.
_SERIAL_PIECE = 1024


def _in_place(x: np.ndarray, ufunc: np.ufunc, method: str) -> Callable[[], object]:
    """``x = ufunc(x)`` in place, as a call that runs on the calling thread.

    torch's ``Tensor.<method>`` when the process has imported torch (its float64 ``sin`` is
    about four times numpy's without AVX-512), else ``ufunc``.
    """
    if "torch" not in sys.modules:
        return lambda: ufunc(x, out=x)
    import torch

    tensor = torch.from_numpy(x)
    step = _SERIAL_PIECE if torch.get_num_threads() > 1 else len(tensor)
    ops = [getattr(tensor[i : i + step], method) for i in range(0, len(tensor), step)]

    def apply() -> None:
        for op in ops:
            op()

    return apply


class SecureRandom(RandomSource):
    """Draws from an AES-256-CTR keystream keyed by ``os.urandom`` afresh at every call."""

    secure = True

    def _stream(self) -> _Fill:
        # The 16-byte CTR "nonce" is the whole initial counter block.
        cipher = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16)))
        encryptor = cipher.encryptor()

        def fill(words: np.ndarray) -> None:
            data = words.data.cast("B")
            for start in range(0, len(data), len(_ZEROS)):
                piece = data[start : start + len(_ZEROS)]
                encryptor.update_into(_ZEROS[: len(piece)], piece)

        return fill


class SeededRandom(RandomSource):
    """Reproducible draws from numpy's PCG64 (insecure: the seed gives every draw)."""

    secure = False

    def __init__(self, seed: int) -> None:
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the stream from ``seed``."""
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def _stream(self) -> _Fill:
        return self._fill

    def _fill(self, words: np.ndarray) -> None:
        np.copyto(words, self._rng.bit_generator.random_raw(words.size))


def random_source(insecure_seed: int | None, *, role: str) -> RandomSource:
    """:class:`SecureRandom`, or :class:`SeededRandom` from ``insecure_seed`` when given.

    The seed is ``privacy.insecure_reproducible``'s, and is used with a warning naming ``role``.
    """
    if insecure_seed is None:
        return SecureRandom()
    _log.warning(
        "%s: privacy.insecure_reproducible = true: DP noise and sampling are drawn from "
        "training.seed; anyone holding the configuration can regenerate and remove the noise "
        "(debugging only, never for private data)",
        role,
    )
    return SeededRandom(insecure_seed)
