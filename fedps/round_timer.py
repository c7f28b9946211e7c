"""Where a round's time goes: :class:`RoundTimer` and the names of a round's phases.

Each role times its own part of a round with one :class:`RoundTimer`, a context manager per
phase (``with timer.phase("pull"): ...``). Phases nest and are counted exclusively: the time
spent inside an inner phase counts for it and not for the phase around it, so the DP noise
drawn inside local training is ``noise``, and ``train`` is the rest of the training. The
phases of one timer therefore add up to at most the time it ran.

The names are fixed here, in round order, for every role that reports them and every reader
that prints them (``fedps bench``, ``fedps status``, the metrics):

- :data:`CLIENT_PHASES`: what an edge client times from its ``TRAIN`` task to its report
  (the report's own call cannot time itself and is not among them);
- :data:`KEYHOLDER_PHASES`: what the key holder times of one ``ApplyRound``;
- :data:`COORDINATOR_PHASES`: the coordinator's own partition of a round, from its opening
  to its record (``commit_wait`` and ``push_wait`` are the clients' time, seen from it);
- :data:`CRITICAL_PATH`: what a round's critical path is made of: the coordinator's
  opening, the phases of the client that committed last, then the servers' phases after the
  pushes, and ``other``, what none of them measured (calls in flight, polling, checkpoints).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = [
    "BEFORE_BARRIER",
    "CLIENT_PHASES",
    "COORDINATOR_PHASES",
    "CRITICAL_PATH",
    "KEYHOLDER_PHASES",
    "RoundTimer",
]

_T = TypeVar("_T")

#: An edge client's phases of a round, in order: the model pulled from the shards, its own
#: evaluation (``task.client_eval``), the round's spend recorded in its privacy ledger (the
#: accountant's epsilon, written durably) and announced to the coordinator, local training
#: (its DP noise apart: ``noise`` is what getting the noise cost the training, drawn then or
#: taken as drawn ahead while the client waited, which no phase counts), the encryptions of
#: zero it drew in the round (offline half) and the encoding into them (online half), the
#: commitment at the key holder (challenge, sketches, signature), the wait for the push phase
#: (the commit barrier) and the push to the shards.
CLIENT_PHASES = (
    "pull",
    "client_eval",
    "spend",
    "announce",
    "train",
    "noise",
    "encrypt_offline",
    "encrypt_online",
    "commit",
    "barrier",
    "push",
)
#: A client's phases up to the barrier: the slowest client by these commits last.
BEFORE_BARRIER = CLIENT_PHASES[: CLIENT_PHASES.index("barrier")]
#: The key holder's phases of applying a round: the shards' sums streamed in, checked against
#: the commitments, the canaries checked and the sums decrypted, flooded and averaged, the
#: server optimizer's step, the state written, the keys rotated (when due), the next version
#: published to the shards.
KEYHOLDER_PHASES = ("fetch", "verify", "decrypt", "apply", "save", "rotate", "publish")
#: The coordinator's own phases of a round, which partition it: opening (the key holder's
#: context, the checkpoint, the commit phase), waiting for the commitments, freezing them,
#: opening the round on the shards, waiting for the pushes, closing it on the shards, the key
#: holder's ``ApplyRound`` call, evaluating the published model (when the round waits for it:
#: the coordinator's own round loop evaluates while the next round runs, off the critical path).
COORDINATOR_PHASES = (
    "open",
    "commit_wait",
    "freeze",
    "shard_open",
    "push_wait",
    "close",
    "apply_call",
    "evaluate",
)
#: A round's critical path, in order (see the module's docstring).
CRITICAL_PATH = (
    "open",
    *CLIENT_PHASES,
    "close",
    *KEYHOLDER_PHASES,
    "evaluate",
    "other",
)


class RoundTimer:
    """Seconds spent in each named phase, phases nested and counted exclusively.

    One timer serves one thread (a role's round loop, one call of the key holder).

    Parameters
    ----------
    clock
        Where the time comes from (default :func:`time.perf_counter`).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._inner: list[float] = []  # for each open phase, the seconds of its inner phases

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside the ``with`` block for phase ``name``.

        Added to what it already has, less the time of the phases opened inside it; an
        exception leaving the block is timed too.
        """
        started = self._clock()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = self._clock() - started
            inner = self._inner.pop()
            self.add(name, elapsed - inner)
            if self._inner:
                self._inner[-1] += elapsed

    def iterate(self, name: str, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, with the time spent waiting for each next item counted for ``name``.

        For a stream read while another phase works on what it yields.
        """
        iterator = iter(items)
        while True:
            with self.phase(name):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` for phase ``name`` (measured elsewhere)."""
        self._seconds[name] = self._seconds.get(name, 0.0) + max(0.0, seconds)

    def seconds(self) -> dict[str, float]:
        """The seconds of each phase so far (a copy)."""
        return dict(self._seconds)

    def reset(self) -> None:
        """Forget every phase (a new round begins)."""
        self._seconds.clear()

    def take(self) -> dict[str, float]:
        """The seconds of each phase so far, and :meth:`reset`."""
        seconds = self.seconds()
        self.reset()
        return seconds
