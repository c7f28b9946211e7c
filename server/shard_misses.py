"""Missed call deadlines, counted per shard: a stalling shard is named, never waited on forever.

Every round needs every shard: the coordinator opens and closes it on each, and the key holder
fetches each one's aggregates. A shard that holds such a call open (or cannot be reached) would
have the caller give up at the deadline and ask again, forever, without anyone being told which
shard holds the run. :class:`ShardMisses` wraps those calls (the key holder's fetch, the
coordinator's opening and closing): a call that ends unanswered
(:class:`~fedps.errors.PeerUnavailableError`) once the shard has been silent for a whole
deadline is a **miss**; any answer, even an error, ends the shard's run of misses (its total
stays). When one shard's run reaches ``limit`` (``security.max_shard_misses``), the call
raises :class:`~fedps.errors.ShardStalledError` naming the shard, the call and what to do, and
the run stops on it.

A shard that is down for a moment (restarting) fails its calls at once and is asked again; it
misses nothing until it has been silent for a whole deadline, so a restart shorter than that
costs no miss. A miss is never evidence of tampering: it is counted apart from detections and
nothing is quarantined for it. The counts live in memory (they start again with the role).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import TypeVar

import grpc

from fedps.errors import FedPSError, PeerUnavailableError, ShardStalledError

__all__ = ["ShardMisses"]

_log = logging.getLogger("fedps")

_T = TypeVar("_T")


class ShardMisses:
    """The misses of each shard's calls: its run in a row and its total.

    Parameters
    ----------
    limit
        Misses in a row of one shard after which its calls raise
        :class:`~fedps.errors.ShardStalledError` (``security.max_shard_misses``).
    deadline_s
        Each call's deadline (``security.shard_deadline_s``): callers pass it to their calls.
    clock
        Monotonic seconds (tests give their own).
    """

    def __init__(
        self, *, limit: int, deadline_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if limit < 1 or not deadline_s > 0:
            raise ValueError("shard misses need limit >= 1 and deadline_s > 0")
        self.limit = limit
        self.deadline_s = deadline_s
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, int] = {}
        self._totals: dict[str, int] = {}
        self._silent_since: dict[str, float] = {}  # when its unanswered calls began
        #: called with (shard, call) for each miss (metrics)
        self.on_miss: Callable[[str, str], None] | None = None

    def call(self, shard: str, call: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, a call named ``call`` to ``shard`` made with :attr:`deadline_s`.

        Its outcome is counted.

        Raises
        ------
        ShardStalledError
            The call missed, and it was the shard's ``limit``-th miss in a row.
        FedPSError
            Whatever ``fn`` raised (an unanswered call below the limit included: ask again).
        """
        started = self._clock()
        try:
            result = fn()
        except PeerUnavailableError as exc:
            self._missed(shard, call, exc, started)
            raise
        except FedPSError:
            self.answered(shard)
            raise
        self.answered(shard)
        return result

    def stream(self, shard: str, call: str, replies: Iterable[_T]) -> Generator[_T, None, None]:
        """The messages of a streamed reply, its outcome counted as :meth:`call` counts it.

        The reply is to ``call`` to ``shard``, made with :attr:`deadline_s`. Read to its end, the
        shard answered; cut off unanswered, it missed. A reader that stops early (it refused a
        message) leaves the count as it was.
        """
        started = self._clock()
        try:
            yield from replies
        except PeerUnavailableError as exc:
            self._missed(shard, call, exc, started)
            raise
        except FedPSError:
            self.answered(shard)
            raise
        self.answered(shard)

    def answered(self, shard: str) -> None:
        """``shard`` answered a call: its run of misses ends (its total stays)."""
        with self._lock:
            self._runs.pop(shard, None)
            self._silent_since.pop(shard, None)

    def totals(self) -> dict[str, int]:
        """Every miss so far, by shard (shards that never missed are absent)."""
        with self._lock:
            return dict(self._totals)

    def in_a_row(self) -> dict[str, int]:
        """The misses since each shard last answered (shards that answered are absent)."""
        with self._lock:
            return dict(self._runs)

    @property
    def stalled(self) -> list[str]:
        """The shards whose run of misses reached the limit, not answered since (sorted)."""
        with self._lock:
            return sorted(s for s, run in self._runs.items() if run >= self.limit)

    def _missed(self, shard: str, call: str, exc: PeerUnavailableError, started: float) -> None:
        """Count a miss; raise :class:`ShardStalledError` at the limit.

        A miss is ``shard``'s unanswered call that ran out its deadline, or a shard that has not
        answered for a whole deadline.
        """
        now = self._clock()
        with self._lock:
            since = self._silent_since.setdefault(shard, started)
            if not (_ran_out(exc) or now - since >= self.deadline_s):
                return  # down for a moment (a restart): asked again, no miss yet
            self._silent_since[shard] = now
            run = self._runs[shard] = self._runs.get(shard, 0) + 1
            total = self._totals[shard] = self._totals.get(shard, 0) + 1
        _log.warning(
            "%s missed its %g s deadline (%s): %d in a row, %d in all; the run stops at %d",
            shard,
            self.deadline_s,
            call,
            run,
            total,
            self.limit,
        )
        if self.on_miss is not None:
            self.on_miss(shard, call)
        if run >= self.limit:
            raise ShardStalledError(
                f"{shard} missed its {self.deadline_s:g} s deadline {run} times in a row "
                f"({call}); every round needs it: restart it or replace it (docs/operations.md)"
            ) from exc


def _ran_out(exc: PeerUnavailableError) -> bool:
    """Whether ``exc`` came from a call that ran out its deadline (``DEADLINE_EXCEEDED``)."""
    cause = exc.__cause__
    return isinstance(cause, grpc.Call) and cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED
