"""Randomness for privacy: DP noise, Poisson sampling, cohort sampling, flooding.

Noise protects only if nobody else can regenerate it. :class:`SecureRandom`, the default
everywhere, draws from a ChaCha20 keystream under a fresh 256-bit key and nonce from the
operating system (``os.urandom``) at every call: nothing is derived from the configuration,
two processes forked from one parent never share a stream, and knowing every earlier output
says nothing about the next.

Floating-point Gaussian samplers leak through the low bits of their output (Mironov 2012 for
Laplace; Jin et al. 2022 and Haney et al. 2022 for Gaussians, the second against Opacus).
:meth:`RandomSource.normal` takes Opacus's ``secure_mode`` mitigation (Holohan and Braghin
2021, section 5.1, with n = 2): each value is the sum of four independent standard Gaussians
divided by 2, so recovering the noise from the output needs a search over ``2^(53 * 3)``
candidates instead of ``2^53``.

:class:`SeededRandom` is the reproducible alternative, only behind
``privacy.insecure_reproducible``: numpy's PCG64 from a seed, so anyone holding the seed
regenerates every draw. It exists for debugging and regression runs, never for privacy.
"""

from __future__ import annotations

import abc
import logging
import math
import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

__all__ = ["RandomSource", "SecureRandom", "SeededRandom", "random_source"]

_log = logging.getLogger("fedps")
_DOUBLE = 1.0 / (1 << 53)


class RandomSource(abc.ABC):
    """Uniform, Gaussian and Bernoulli draws from one source of random bits."""

    #: whether nobody else can reproduce the draws
    secure: bool

    @abc.abstractmethod
    def _words(self, count: int) -> np.ndarray:
        """``count`` uniformly random 64-bit words."""

    def uniform(self, count: int) -> np.ndarray:
        """``count`` doubles uniform in [0, 1), on the grid of multiples of 2^-53."""
        out: np.ndarray = (self._words(count) >> np.uint64(11)).astype(np.float64) * _DOUBLE
        return out

    def normal(self, std: float, shape: int | tuple[int, ...]) -> np.ndarray:
        """Gaussian noise N(0, std^2) of ``shape``, hardened against the floating-point attack.

        Float64; each value is (z1 + z2 + z3 + z4) / 2 * std, four independent standard Gaussians
        (Box-Muller, both outputs used).
        """
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        count = math.prod(dims)
        if std == 0 or count == 0:
            return np.zeros(dims)
        pairs = 2 * count  # four standard Gaussians per value, two per Box-Muller pair
        u = self.uniform(2 * pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))  # 1 - u is in (0, 1]: no log(0)
        angle = (2.0 * math.pi) * u[pairs:]
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
        total = z.reshape(4, count).sum(axis=0)
        out: np.ndarray = (total * (std / 2.0)).reshape(dims)
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


class SecureRandom(RandomSource):
    """Draws from a ChaCha20 keystream keyed by ``os.urandom`` afresh at every call."""

    secure = True

    def _words(self, count: int) -> np.ndarray:
        if count <= 0:
            return np.zeros(0, dtype=np.uint64)
        # The 16-byte "nonce" of cryptography's ChaCha20 is the counter and nonce together.
        cipher = Cipher(algorithms.ChaCha20(os.urandom(32), os.urandom(16)), mode=None)
        stream = cipher.encryptor().update(bytes(8 * count))
        return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


class SeededRandom(RandomSource):
    """Reproducible draws from numpy's PCG64 (insecure: the seed gives every draw)."""

    secure = False

    def __init__(self, seed: int) -> None:
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the stream from ``seed``."""
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def _words(self, count: int) -> np.ndarray:
        words: np.ndarray = self._rng.integers(
            0, np.iinfo(np.uint64).max, size=max(count, 0), dtype=np.uint64, endpoint=True
        )
        return words


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
