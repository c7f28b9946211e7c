"""The coordinator's shard ring: which shards are on it, its version, and every move.

The configured shards (but ``cluster.standby``) are ring version 0. A shard is **declared gone**
when it has not answered
the coordinator's calls for ``cluster.shard_gone_after_s`` seconds (:meth:`RingKeeper.unreachable`),
when the key holder quarantined it on proven tampering (:meth:`RingKeeper.quarantined`), or when
the operator removes it (:meth:`RingKeeper.remove`). The keeper then removes it from the
ring (:meth:`RingView.without <fedps.sharding.ring_view.RingView.without>`, which moves only its
blocks, each to the next shard along the ring) and counts one version up. The operator **adds** a
configured shard that is off the ring, empty (a standby, or a shard declared gone that came back
with its old state discarded), with :meth:`RingKeeper.join`: it joins between rounds
(:meth:`RingKeeper.admit_joins`, before the next round's clients pull), one version up, and takes
about ``1 / S`` of the blocks (:meth:`RingView.with_node
<fedps.sharding.ring_view.RingView.with_node>`). The coordinator
publishes the ring with every call that needs it: the key holder's commit phase and round
application, the shards' round openings, the clients' tasks; the ring and its moves are kept in the
coordinator's checkpoint (:meth:`RingKeeper.state_dict`), so a restarted coordinator goes on with
the ring it published, never an older one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from crypto.files import private_directory, read_checked, write_checked
from fedps.errors import ConfigError, PeerUnavailableError
from fedps.sharding.ring_view import RingView
from fedps.storage.write_retry import write_until_written

__all__ = ["RING_FILE", "RingKeeper", "RingMove", "ShardGoneError"]

_log = logging.getLogger("fedps")

#: The ring file's name in the coordinator's state folder.
RING_FILE = "ring.json"


class ShardGoneError(PeerUnavailableError):
    """A shard was declared gone: the ring moved on without it (``view`` is the new ring).

    The coordinator's own signal, caught where a round moves to the new ring; an unavailable
    peer, were it ever to cross the wire.
    """

    def __init__(self, message: str, view: RingView) -> None:
        super().__init__(message)
        self.view = view


@dataclass(frozen=True)
class RingMove:
    """One change of the ring: the version it made, the shard removed or added, and why."""

    version: int
    removed: str  # "" when a shard was added
    reason: str
    at: float  # Unix seconds
    added: str = ""

    @property
    def line(self) -> str:
        """The move as ``fedps status`` shows it."""
        if self.added:
            return f"version {self.version}: {self.added} added ({self.reason})"
        return f"version {self.version}: {self.removed} removed ({self.reason})"


class RingKeeper:
    """The shard ring the coordinator publishes, and the shards' silences that move it.

    Parameters
    ----------
    shard_ids
        The shards on the ring when the run starts: ring version 0.
    gone_after_s
        Seconds a shard may leave the coordinator's calls unanswered before it is declared gone
        (``cluster.shard_gone_after_s``; 0: never, a silent shard stalls the run instead).
    clock
        Monotonic seconds (tests give their own).
    known
        Every configured shard, on the ring or not (None: ``shard_ids``): only these can join.
    check_empty
        Raises unless a shard the operator adds answers and is empty (None: not checked).
    path
        Where every change is saved before anyone is told it (a checked state file, 0600;
        None: nowhere): a coordinator that restarts between a change and its next checkpoint
        goes on with the ring it published, never an older one (:meth:`load_state_dict`).
    stop
        Set when the coordinator stops: ends the retries of a write that fails (a full disk).
    """

    def __init__(
        self,
        shard_ids: Sequence[str],
        *,
        gone_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        known: Sequence[str] | None = None,
        check_empty: Callable[[str], None] | None = None,
        path: Path | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._path = path
        self._stop = stop or threading.Event()
        self._lock = threading.RLock()  # unreachable() removes in it
        self._view = RingView.configured(shard_ids)
        self._known = frozenset(shard_ids if known is None else known)
        self._check_empty = check_empty
        self._gone_after_s = gone_after_s
        self._clock = clock
        self._silent_since: dict[str, float] = {}
        self._joining: list[str] = []  # added by the operator, on the ring at the next round
        self.moves: list[RingMove] = []  #: every change of the ring, oldest first

    @property
    def joining(self) -> tuple[str, ...]:
        """The shards the operator added that join the ring at the next round."""
        with self._lock:
            return tuple(self._joining)

    @property
    def view(self) -> RingView:
        """The ring now."""
        with self._lock:
            return self._view

    def now(self) -> float:
        """The keeper's clock (the ``asked_at`` of :meth:`unreachable`)."""
        return self._clock()

    def answered(self, shard: str) -> None:
        """``shard`` answered a call: its silence ends."""
        with self._lock:
            self._silent_since.pop(shard, None)

    def unreachable(self, shard: str, asked_at: float | None = None) -> RingView | None:
        """``shard`` left a call unanswered; the new ring if that declared it gone.

        ``asked_at`` is when the call was made (``clock`` seconds; None: now): a shard is silent
        from the first call it left unanswered, made, not failed (a shard cut off the network
        fails a call only at its deadline). It is declared gone once it has been silent for
        ``gone_after_s`` (and is still on the ring, and not the last shard): it is removed from
        the ring.
        """
        now = self._clock()
        with self._lock:
            since = self._silent_since.setdefault(shard, now if asked_at is None else asked_at)
            silent = now - since
            if not (0 < self._gone_after_s <= silent):
                return None
            if shard not in self._view.nodes or len(self._view.nodes) == 1:
                return None
            # in the lock: two last shards silent at once never both pass the check above
            return self.remove(shard, f"unreachable for {silent:.1f} s")

    def remove(self, shard: str, reason: str = "removed by the operator") -> RingView:
        """Remove ``shard`` from the ring (its blocks move along the ring); returns the new ring.

        Raises
        ------
        ConfigError
            ``shard`` is not on the ring, or it is the last shard.
        """
        with self._lock:
            view = self._view.without(shard)
            moves = [*self.moves, RingMove(view.version, shard, reason, time.time())]
            self._save(view, moves, self._joining)  # durable before anyone reads it
            self._view, self.moves = view, moves
            self._silent_since.pop(shard, None)
        _log.warning(
            "%s declared gone (%s): ring version %d is %s; its blocks move to them",
            shard,
            reason,
            view.version,
            ", ".join(view.nodes),
        )
        return view

    def quarantined(self, shards: Collection[str]) -> list[str]:
        """Declare gone each of ``shards`` (quarantined on proven tampering) on the ring.

        The key holder decrypts nothing from a ring that holds a quarantined shard, and counts
        a shard's tampering only on proof (docs/security.md): each is removed
        (:meth:`remove`). Returns those left on the ring: the last shard is never removed.
        """
        left = []
        for shard in sorted(shards):
            view = self.view
            if shard not in view.nodes:
                continue
            if len(view.nodes) == 1:
                left.append(shard)
                continue
            self.remove(shard, "quarantined: the key holder proved it tampered")
        return left

    def join(self, shard: str) -> None:
        """Add ``shard`` to the ring at the next round (:meth:`admit_joins`), as the operator.

        The shard must be empty (``check_empty``): it holds no model and no round.

        Raises
        ------
        ConfigError
            ``shard`` is not a configured shard, is on the ring, or joins already.
        FedPSError
            What ``check_empty`` raises: the shard is not empty, or does not answer.
        """
        self._joinable(shard)
        if self._check_empty is not None:
            self._check_empty(shard)
        with self._lock:
            self._joinable(shard)
            self._save(self._view, self.moves, [*self._joining, shard])  # durable when it is said
            self._joining.append(shard)
        _log.warning("%s joins the ring at the next round (added by the operator)", shard)

    def _joinable(self, shard: str) -> None:
        """Raise :class:`ConfigError` unless ``shard`` may join (see :meth:`join`)."""
        if shard not in self._known:
            raise ConfigError(f"{shard!r} is not a shard of cluster.shards")
        if shard in self._view.nodes:
            raise ConfigError(f"{shard!r} is on the ring already (version {self._view.version})")
        if shard in self._joining:
            raise ConfigError(f"{shard!r} joins the ring at the next round already")

    def admit_joins(self) -> RingView | None:
        """Put the shards that join on the ring, one version each; the new ring (None: none).

        Called between rounds: only the blocks each takes move, all to it.
        """
        with self._lock:
            views, moves = [self._view], list(self.moves)
            for shard in self._joining:
                views.append(view := views[-1].with_node(shard))
                moves.append(
                    RingMove(view.version, "", "joined by the operator", time.time(), added=shard)
                )
            joining = self._joining
            if joining:
                self._save(views[-1], moves, [])  # durable before anyone reads it
            self._view, self.moves, self._joining = views[-1], moves, []
            for shard, view in zip(joining, views[1:], strict=True):
                self._silent_since.pop(shard, None)
                _log.warning(
                    "%s joined: ring version %d is %s; the blocks it takes move to it",
                    shard,
                    view.version,
                    ", ".join(view.nodes),
                )
            return self._view if joining else None

    def status_lines(self) -> tuple[str, ...]:
        """Every move, a line each, oldest first, then the joins to come (for ``fedps status``)."""
        with self._lock:
            return tuple(m.line for m in self.moves) + tuple(
                f"{s} joins at the next round" for s in self._joining
            )

    def state_dict(self) -> dict[str, Any]:
        """The ring, its moves and the joins to come, JSON-ready (for the checkpoint)."""
        with self._lock:
            return _state(self._view, self.moves, self._joining)

    def _save(self, view: RingView, moves: list[RingMove], joining: list[str]) -> None:
        """Write the ring file (``path``), if there is one, until it is written.

        A full disk holds the change, logged, until space is freed (as a checkpoint does).
        """
        path = self._path
        if path is None:
            return
        data = json.dumps(_state(view, moves, joining)).encode()
        private_directory(path.parent)
        write_until_written(
            lambda: write_checked(path, data),
            retry_on=OSError,
            failure=lambda exc: f"cannot write the shard ring {path} ({exc})",
            stop=self._stop,
        )

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """Go on with the ring of :meth:`state_dict` (None: a checkpoint without one).

        Or with the ring file's, if it holds a later version, or the same with joins to come
        (saved after the checkpoint). Returns whether the file's ring is a later version than
        the checkpoint's (the ring moved after it was written).

        Raises
        ------
        CorruptStateError
            The ring file is damaged.
        """
        saved = None
        if self._path is not None:
            hint = "restore it, or move it aside to go on with the checkpoint's ring"
            data = read_checked(self._path, what="the shard ring", hint=hint)
            saved = None if data is None else json.loads(data)
        checkpointed = int(state["version"]) if state else 0
        if saved and (not state or int(saved["version"]) >= checkpointed):
            state = saved
        if not state:
            return False
        with self._lock:
            self._view = RingView(int(state["version"]), tuple(state["nodes"]))
            self.moves = [RingMove(**m) for m in state["moves"]]
            self._joining = list(state.get("joining", []))
        return self._view.version > checkpointed


def _state(view: RingView, moves: list[RingMove], joining: list[str]) -> dict[str, Any]:
    """A ring, its moves and the joins to come, JSON-ready."""
    return {
        "version": view.version,
        "nodes": list(view.nodes),
        "moves": [asdict(m) for m in moves],
        "joining": list(joining),
    }
