"""The coordinator's shard ring: which shards are on it, its version, and every move.

The configured shards are ring version 0. A shard is **declared gone** when it has not answered
the coordinator's calls for ``cluster.shard_gone_after_s`` seconds (:meth:`RingKeeper.unreachable`),
or when the operator removes it (:meth:`RingKeeper.remove`). The keeper then removes it from the
ring (:meth:`RingView.without <fedps.sharding.ring_view.RingView.without>`, which moves only its
blocks, each to the next shard along the ring) and counts one version up. The coordinator
publishes the ring with every call that needs it: the key holder's commit phase and round
application, the shards' round openings, the clients' tasks; the ring and its moves are kept in the
coordinator's checkpoint (:meth:`RingKeeper.state_dict`), so a restarted coordinator goes on with
the ring it published, never an older one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fedps.errors import FedPSError
from fedps.sharding.ring_view import RingView

__all__ = ["RingKeeper", "RingMove", "ShardGoneError"]

_log = logging.getLogger("fedps")


class ShardGoneError(FedPSError):
    """A shard was declared gone: the ring moved on without it (``view`` is the new ring)."""

    def __init__(self, message: str, view: RingView) -> None:
        super().__init__(message)
        self.view = view


@dataclass(frozen=True)
class RingMove:
    """One change of the ring: the version it made, the shard removed, and why."""

    version: int
    removed: str
    reason: str
    at: float  # Unix seconds


class RingKeeper:
    """The shard ring the coordinator publishes, and the shards' silences that move it.

    Parameters
    ----------
    shard_ids
        The configured shards: ring version 0.
    gone_after_s
        Seconds a shard may leave the coordinator's calls unanswered before it is declared gone
        (``cluster.shard_gone_after_s``; 0: never, a silent shard stalls the run instead).
    clock
        Monotonic seconds (tests give their own).
    """

    def __init__(
        self,
        shard_ids: Sequence[str],
        *,
        gone_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._view = RingView.configured(shard_ids)
        self._gone_after_s = gone_after_s
        self._clock = clock
        self._silent_since: dict[str, float] = {}
        self.moves: list[RingMove] = []  #: every change of the ring, oldest first

    @property
    def view(self) -> RingView:
        """The ring now."""
        with self._lock:
            return self._view

    def answered(self, shard: str) -> None:
        """``shard`` answered a call: its silence ends."""
        with self._lock:
            self._silent_since.pop(shard, None)

    def unreachable(self, shard: str) -> RingView | None:
        """``shard`` left a call unanswered; the new ring if that declared it gone.

        It is declared gone once it has been silent for ``gone_after_s`` (and is still on the
        ring, and not the last shard): it is removed from the ring.
        """
        now = self._clock()
        with self._lock:
            since = self._silent_since.setdefault(shard, now)
            silent = now - since
            if not (0 < self._gone_after_s <= silent):
                return None
            if shard not in self._view.nodes or len(self._view.nodes) == 1:
                return None
        return self.remove(shard, f"unreachable for {silent:.1f} s")

    def remove(self, shard: str, reason: str = "removed by the operator") -> RingView:
        """Remove ``shard`` from the ring (its blocks move along the ring); returns the new ring.

        Raises
        ------
        ConfigError
            ``shard`` is not on the ring, or it is the last shard.
        """
        with self._lock:
            self._view = view = self._view.without(shard)
            self._silent_since.pop(shard, None)
            self.moves.append(RingMove(view.version, shard, reason, time.time()))
        _log.warning(
            "%s declared gone (%s): ring version %d is %s; its blocks move to them",
            shard,
            reason,
            view.version,
            ", ".join(view.nodes),
        )
        return view

    def status_lines(self) -> tuple[str, ...]:
        """Every move, a line each, oldest first (for ``fedps status``)."""
        with self._lock:
            return tuple(
                f"version {m.version}: {m.removed} removed ({m.reason})" for m in self.moves
            )

    def state_dict(self) -> dict[str, Any]:
        """The ring and its moves, JSON-ready (for the checkpoint)."""
        with self._lock:
            return {
                "version": self._view.version,
                "nodes": list(self._view.nodes),
                "moves": [asdict(m) for m in self.moves],
            }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Go on with the ring of :meth:`state_dict` (None: a checkpoint without one)."""
        if not state:
            return
        with self._lock:
            self._view = RingView(int(state["version"]), tuple(state["nodes"]))
            self.moves = [RingMove(**m) for m in state["moves"]]
