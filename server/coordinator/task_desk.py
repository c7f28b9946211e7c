"""The coordinator's task desk: each client's task, its reports, and the long poll.

A client's ``GetTask`` and ``ReportUpdate`` calls are answered here. The round loop
(:class:`~.coordinator.Coordinator`) shows the desk what the clients may see: the round in
progress and its phase (:attr:`TaskDesk.open_round`), the last finished round, whether the run
is done and the key holder's current key generation. A call whose answer would be WAIT is held
until the client's task changes (a long poll), at most :data:`MAX_HOLD_S` seconds and
``settings.max_held_calls`` calls at once, each holding a server thread. Every call is
authenticated, and the privacy spend it carries recorded, by the client registry
(:class:`~.client_registry.ClientRegistry`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fedps.round_timer import CLIENT_PHASES
from fedps.rpc.coordinator_messages import RETRY_AFTER_S, Assignment
from server.coordinator.client_registry import ClientRegistry
from server.coordinator.ring_keeper import RingKeeper
from server.coordinator.round_record import (
    OpenRound,
    check_metrics,
    check_phase_seconds,
    known_phases,
)

__all__ = ["MAX_HOLD_S", "TaskDesk"]

#: The longest a ``GetTask`` call is held while its answer would be WAIT (a long poll).
MAX_HOLD_S = 5.0


class TaskDesk:
    """Hands the clients their tasks and takes their reports, for the coordinator's round loop.

    The round loop sets :attr:`open_round` (holding ``changed``'s lock, then notifying it),
    :attr:`round`, :attr:`finished` and :attr:`context_id`; the desk notifies ``changed`` on
    every report and waits on it while it holds a call.

    Parameters
    ----------
    registry
        The clients (authentication, liveness, privacy spend).
    changed
        The coordinator's condition: its lock guards the open round, and it is notified on
        every change (a registration, a report, a round, a stop).
    stop
        Set when the coordinator stops: a held call is answered at once.
    max_held_calls
        How many ``GetTask`` calls may be held at once (``settings.max_held_calls``).
    client_eval
        Whether the metrics a client reports are kept for the open round's record (the
        operator holds no evaluation data: ``task.client_eval``).
    """

    def __init__(
        self,
        registry: ClientRegistry,
        changed: threading.Condition,
        *,
        stop: threading.Event,
        max_held_calls: int,
        client_eval: bool,
    ) -> None:
        self.registry = registry
        self._changed = changed
        self._stop = stop
        self.max_held_calls = max_held_calls
        self._client_eval = client_eval
        self._held_calls = 0  # GetTask calls held (a long poll), each holding a server thread
        self.recheck_commitments = False  # a cohort member asked: it may have committed
        #: the round in progress as the clients see it (None between its phases and rounds)
        self.open_round: OpenRound | None = None
        self.round = 0  # the last finished round (WAIT and DONE carry it)
        self.finished = False  # the run is done: every task is DONE
        self.told_done: set[str] = set()  # the clients whose task was DONE
        self.context_id = ""  # the key holder's current CKKS context (TRAIN tasks name it)
        #: the shard ring (TRAIN and PUSH tasks carry it: the clients pull and push on it)
        self.ring: RingKeeper | None = None

    def get_task(
        self,
        client_id: str,
        credential: bytes = b"",
        *,
        epsilon: float = 0.0,
        delta: float = 0.0,
        wait_s: float = 0.0,
        committed_round: int = 0,
    ) -> Assignment:
        """The next task for ``client_id`` (authenticated by its credential).

        The client says it has spent ``epsilon`` (at ``delta``) so far.

        While the answer would be WAIT, the call is held up to ``wait_s`` seconds (capped at
        :data:`MAX_HOLD_S`) and answered as soon as the client's task changes: a waiting
        client learns of a new round or of the push phase without polling. At most
        :attr:`max_held_calls` calls are held at once (each holds a server thread);
        beyond that WAIT is answered at once. A held call that still answers WAIT says to
        ask again at once (``retry_after`` 0): it has waited already. A cohort member that says
        it committed to the open round (``committed_round``) waits for the push phase: its
        answer is WAIT, not TRAIN again (what it committed is the key holder's to say; the
        commit phase asks it at once).

        Raises
        ------
        InvalidArgumentError
            An epsilon or delta out of range.
        UnknownClientError, UnauthenticatedError
            See :meth:`ClientRegistry.check_in`.
        """
        self.registry.check_in(client_id, credential, epsilon=epsilon, delta=delta)
        hold_s = min(wait_s, MAX_HOLD_S) if math.isfinite(wait_s) and wait_s > 0 else 0.0
        until = time.monotonic() + hold_s
        held = False
        with self._changed:
            current = self.open_round
            if current is not None and not current.pushing and client_id in current.cohort:
                # A cohort member asks while commitments come in: it may have committed, so
                # the commit phase asks the key holder again now, not at its next poll.
                self.recheck_commitments = True
                self._changed.notify_all()
            try:
                while True:
                    task = self._task_for(client_id, committed_round)
                    left = until - time.monotonic()
                    if task.kind != "wait" or left <= 0 or self._stop.is_set():
                        break
                    if not held:
                        if self._held_calls >= self.max_held_calls:
                            break
                        self._held_calls, held = self._held_calls + 1, True
                    self._changed.wait(timeout=left)
            finally:
                if held:
                    self._held_calls -= 1
            if task.kind == "done":
                self.told_done.add(client_id)
        if held and task.kind == "wait":
            return replace(task, retry_after=0.0)
        return task

    def _task_for(self, client_id: str, committed_round: int = 0) -> Assignment:
        """``client_id``'s task now (the caller holds the lock).

        ``committed_round``: the round it says it committed to (see :meth:`get_task`).
        """
        # WAIT and DONE carry the last finished round: at client level every global round
        # counts in a client's spend, the rounds it was not drawn for too.
        if self.finished:
            return Assignment("done", self.round)
        current = self.open_round
        in_round = current is not None and client_id in current.cohort
        if not in_round and self.registry.spent_out(client_id):
            # the server's ledger says one more round takes it past the target: it is done,
            # whatever its own state folder says
            return Assignment("done", self.round)
        if current is None or client_id in current.reported or time.time() >= current.deadline:
            return Assignment("wait", self.round)
        if current.pushing and client_id in current.committed:
            ring = self._ring_fields()
            return Assignment("push", current.round, current.version, current.deadline, **ring)
        if not current.pushing and client_id in current.cohort:
            if committed_round == current.round:  # committed: it waits for the push phase
                return Assignment("wait", self.round)
            return Assignment(
                "train",
                current.round,
                current.version,
                current.deadline,
                weight_scale=float(self.registry.most_examples(current.cohort)),
                context_id=self.context_id,
                **self._ring_fields(),
            )
        return Assignment("wait", self.round)

    def _ring_fields(self) -> dict[str, Any]:
        """The ring's fields of a task (none before a ring is given)."""
        return {} if self.ring is None else self.ring.view.fields()

    def report(
        self,
        client_id: str,
        round_: int,
        *,
        epsilon: float,
        delta: float,
        bytes_pushed: int,
        budget_exhausted: bool,
        credential: bytes = b"",
        noise_multiplier: float | None = None,
        metrics: Mapping[str, float] | None = None,
        phase_seconds: Mapping[str, float] | None = None,
    ) -> None:
        """A client says it pushed its update for ``round_`` (or ran out of budget).

        It trains with DP noise multiplier ``noise_multiplier`` (``None``: not said). ``metrics``:
        the task's metrics on its own data (``task.client_eval``), kept for the open round's record
        when the operator holds no evaluation data. ``phase_seconds``: the seconds it spent in
        each phase of the round (:data:`fedps.round_timer.CLIENT_PHASES`; other names are left
        out), kept for the open round's record.

        Raises
        ------
        InvalidArgumentError, UnknownClientError, UnauthenticatedError
            See :meth:`ClientRegistry.record_report`; or ``metrics`` not finite, more than
            16 of them, or a name longer than 64 characters; or ``phase_seconds`` not within
            [0, a week], more than 32 of them, or a name longer than 32 characters.
        """
        if metrics:
            check_metrics(metrics)
        if phase_seconds:
            check_phase_seconds(phase_seconds)
        self.registry.record_report(
            client_id,
            credential,
            epsilon=epsilon,
            delta=delta,
            bytes_pushed=bytes_pushed,
            budget_exhausted=budget_exhausted,
            noise_multiplier=noise_multiplier,
        )
        with self._changed:
            if self.open_round is not None and self.open_round.round == round_:
                self.open_round.reported.add(client_id)
                if metrics and self._client_eval:
                    self.open_round.metrics[client_id] = dict(metrics)
                if phase_seconds:
                    self.open_round.phases[client_id] = known_phases(phase_seconds, CLIENT_PHASES)
            self._changed.notify_all()

    def wait_until_pushing(self, round_: int, timeout_s: float) -> bool:
        """Wait until ``round_``'s commitments are frozen and its shards take pushes.

        False when the round ended first (too few commitments) or ``timeout_s`` passed.
        """
        until = time.time() + timeout_s
        with self._changed:
            while time.time() < until and not self._stop.is_set():
                current = self.open_round
                if current is not None and current.round == round_ and current.pushing:
                    return True
                if self.round >= round_:
                    return False
                self._changed.wait(timeout=RETRY_AFTER_S)
        return False

    def reported_in_open_round(self) -> int:
        """Updates reported so far in the open round or buffer (0 between rounds)."""
        current = self.open_round
        return len(current.reported) if current is not None else 0
