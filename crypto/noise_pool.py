"""Gaussian noise drawn ahead of the round that adds it, while its role waits.

A client's DP noise, and a key-holder party's flooding (:mod:`crypto.partial_decryptor`).

The Gaussian noise a round adds does not depend on the model or the data: its standard
deviation, the parameters' shapes and the number of steps are known before the round. A
client draws it in the time it would otherwise idle, between pushing one round's update and
its next ``TRAIN`` task, and its trainer takes the drawn values where it adds noise
(:class:`NoisePool`); whatever is not ready then (the pool not full yet, a step more than
planned, another std or shape) is drawn on demand, as before.

The noise stays exactly as private (docs/privacy.md):

- every value is a draw of the trainer's own source,
  :meth:`crypto.randomness.RandomSource.normal` (the hardened Gaussian of
  :class:`~crypto.randomness.SecureRandom`), drawn in pieces of :data:`_PIECE` values, each
  under a fresh key as every draw is: the same distribution, value for value;
- each array is handed out once, and the pool keeps no reference to it; nothing is written
  anywhere or logged; the pool is in memory only, bounded (``max_bytes``), and dropped when
  the noise asked for changes (another std or shape) or the trainer closes;
- a reproducible source (:class:`~crypto.randomness.SeededRandom`, behind
  ``privacy.insecure_reproducible``) is never drawn ahead: the thread would interleave its
  draws with the Poisson sampling's on the same stream, in an order that depends on timing.
  It draws on demand, so a seeded run stays reproducible.

The drawing runs on one background thread at Linux's lowest priority (nice 19, set on the
thread alone), in pieces short enough (a few milliseconds each) that it stops soon when told
to: the trainer stops it when a round's training starts, never waits for it, and draws what
is missing itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from crypto.randomness import RandomSource

__all__ = ["DEFAULT_MAX_BYTES", "NoiseDraw", "NoisePool"]

_log = logging.getLogger("fedps")

#: The pool's default bound: 256 MiB, five rounds of DP-SGD noise for a 1M-parameter model
#: at 12 steps per round (float32).
DEFAULT_MAX_BYTES = 256 << 20
#: Values per background draw: about 4 ms of the hardened Gaussian on one core, the longest
#: the thread goes on drawing after it is told to stop.
_PIECE = 1 << 16
_THREAD_NAME = "fedps-noise-ahead"


class NoiseDraw(NamedTuple):
    """One array of Gaussian noise as a trainer asks for it.

    Attributes
    ----------
    std
        Its standard deviation.
    shape
        Its shape.
    dtype
        ``np.float32`` or ``np.float64``.
    """

    std: float
    shape: tuple[int, ...]
    dtype: type[np.float32] | type[np.float64]

    @property
    def size(self) -> int:
        """Its number of values."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes its values take."""
        return self.size * np.dtype(self.dtype).itemsize


class NoisePool:
    """Gaussian noise drawn ahead by a low-priority thread; each array handed out once.

    :meth:`fill` plans the draws of the next round and starts drawing them in the background;
    :meth:`normal` takes a drawn array of the asked std, shape and dtype, or draws one on demand;
    :meth:`stop` stops the drawing (a round starts), keeping what is ready; :meth:`close` ends
    the thread and drops the pool.

    Parameters
    ----------
    source
        Where every value comes from; a source that is not secure is never drawn ahead.
    max_bytes
        The most the pool holds, drawn or being drawn (0: draw only on demand).

    Attributes
    ----------
    taken, drawn
        Arrays :meth:`normal` took from the pool, and drew on demand.
    """

    def __init__(self, source: RandomSource, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.source = source
        self.max_bytes = max_bytes if source.secure else 0
        self.taken = 0
        self.drawn = 0
        self._cond = threading.Condition()
        self._ready: dict[NoiseDraw, deque[np.ndarray]] = {}
        self._todo: deque[NoiseDraw] = deque()
        self._planned: frozenset[NoiseDraw] = frozenset()
        self._reserved = 0  # bytes ready, to draw and being drawn
        self._generation = 0  # changes when the draw in progress is no longer wanted
        self._drawing: tuple[NoiseDraw, int] | None = None  # being drawn, for that generation
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def reserved_bytes(self) -> int:
        """The bytes the pool holds or is drawing (at most ``max_bytes``)."""
        return self._reserved

    def ready(self, draw: NoiseDraw) -> int:
        """How many arrays of ``draw`` are ready."""
        with self._cond:
            return len(self._ready.get(draw, ()))

    def fill(self, draws: Sequence[NoiseDraw]) -> None:
        """Start drawing ``draws`` in the background, less what is ready; returns at once.

        ``draws`` is the next round's noise in the order it will be asked for; what would take
        the pool past ``max_bytes`` is left to be drawn on demand, and so is noise of std 0
        (zeros). A pool drawn for other draws (another std or shape) is dropped first.
        """
        if self.max_bytes <= 0:
            return
        with self._cond:
            if frozenset(draws) != self._planned:
                self._discard()
                self._planned = frozenset(draws)
            have = {draw: len(ready) for draw, ready in self._ready.items()}
            drawing = self._drawing
            wanted = [drawing[0]] if drawing and drawing[1] == self._generation else []
            for draw in [*self._todo, *wanted]:
                have[draw] = have.get(draw, 0) + 1
            for draw in draws:
                if have.get(draw, 0) > 0:
                    have[draw] -= 1
                elif draw.std > 0 and self._reserved + draw.nbytes <= self.max_bytes:
                    self._todo.append(draw)
                    self._reserved += draw.nbytes
            if self._todo and self._thread is None:
                self._thread = threading.Thread(target=self._work, name=_THREAD_NAME, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def normal(
        self,
        std: float,
        shape: tuple[int, ...],
        *,
        dtype: type[np.float32] | type[np.float64] = np.float64,
    ) -> np.ndarray:
        """N(0, std^2) noise of ``shape`` and ``dtype``: drawn ahead if ready, else now.

        The array is the caller's: the pool keeps no reference to it. A draw the plan does not
        hold (another std or shape) drops the pool.
        """
        draw = NoiseDraw(std, tuple(shape), dtype)
        with self._cond:
            ready = self._ready.get(draw)
            if ready:
                values = ready.popleft()
                self._reserved -= draw.nbytes
                self.taken += 1
                return values
            if self._planned and draw not in self._planned:  # the noise changed
                self._discard()
                self._planned = frozenset()
            self.drawn += 1
        return self.source.normal(std, draw.shape, dtype=dtype)

    def stop(self) -> None:
        """Stop drawing ahead (training starts): what is ready stays, the rest is not drawn."""
        with self._cond:
            self._reserved -= sum(draw.nbytes for draw in self._todo)
            self._todo.clear()
            self._generation += 1

    def wait(self, timeout_s: float) -> bool:
        """Wait until nothing is left to draw, at most ``timeout_s``; whether so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._todo and self._drawing is None, timeout_s)

    def close(self) -> None:
        """End the thread and drop the pool; a later :meth:`fill` starts a new thread."""
        with self._cond:
            self._discard()
            self._planned = frozenset()
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            self._closing, self._thread = False, None

    def _discard(self) -> None:
        """Drop what is ready and what is to draw (the caller holds the lock)."""
        self.stop()
        self._reserved -= sum(d.nbytes * len(ready) for d, ready in self._ready.items())
        self._ready.clear()

    def _work(self) -> None:
        """The thread: draw what :meth:`fill` planned, until :meth:`close`."""
        _lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._todo) or self._closing)
                if self._closing:
                    return
                draw, generation = self._todo.popleft(), self._generation
                self._drawing = draw, generation
            try:
                values = self._draw(draw, generation)
            except Exception as exc:  # the trainer draws it on demand instead
                _log.warning("drawing DP noise ahead failed (%s); drawn on demand", exc)
                values = None
            with self._cond:
                self._drawing = None
                if values is not None and generation == self._generation:
                    self._ready.setdefault(draw, deque()).append(values)
                else:  # stopped or dropped while it was drawn
                    self._reserved -= draw.nbytes
                self._cond.notify_all()

    def _draw(self, draw: NoiseDraw, generation: int) -> np.ndarray | None:
        """``draw``'s values, piece by piece; None once ``generation`` has passed."""
        values = np.empty(draw.shape, dtype=draw.dtype)
        flat = values.reshape(-1)
        for start in range(0, flat.size, _PIECE):
            if self._generation != generation:  # stopped: the pool no longer wants it
                return None
            piece = flat[start : start + _PIECE]
            piece[...] = self.source.normal(draw.std, piece.size, dtype=draw.dtype)
        return values


def _lower_priority() -> None:
    """Give the calling thread alone Linux's lowest priority, nice 19.

    Elsewhere nothing changes: ``PRIO_PROCESS`` with a thread id is Linux's per-thread
    niceness only.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
