"""A round's two phases with its clients: commit, then push.

1. **Commit.** The round's commit phase opens at the key holder with the current model
   version, and the cohort gets ``TRAIN`` tasks. Each client trains, encrypts and commits its
   signed update (and its ciphertexts' sketches) at the key holder. When the round policy says
   the commit phase is complete (sync: every member has committed or said it has nothing to
   send; async: ``buffer_size`` updates are committed), or at its deadline (sync only), the
   coordinator freezes the commitments.
2. **Push.** Only then is the round opened on every shard, for exactly the committed clients
   and their commitments; they push their ciphertexts and report. The round closes when all of
   them reported or the push deadline passes. Shards report which clients pushed all their
   blocks: those the key holder may aggregate.

No client's ciphertext can thus depend on another's of the same round (docs/security.md).

A shard declared gone while the round is opened, pushed to or closed on the shards
(:class:`~.ring_keeper.ShardGoneError`) moves the ring on without it: the round is opened again
on the shards left, with the new ring (they keep what they took and own the moved blocks now),
its push phase starts again, and every committed client gets a push task with the new ring and
pushes the blocks that moved, the same committed ciphertexts.
A member that misses a phase's deadline is left out of cohorts until it asks for a task
again (a dead client).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fedps.errors import FedPSError, ShardStalledError
from fedps.round_timer import RoundTimer
from fedps.rpc.coordinator_messages import RETRY_AFTER_S
from fedps.rpc.keyholder_messages import CommitOpening, CommitSet
from server.coordinator.client_registry import ClientRegistry
from server.coordinator.cluster_peers import ClusterPeers
from server.coordinator.ring_keeper import ShardGoneError
from server.coordinator.round_policy import RoundPolicy
from server.coordinator.round_record import OpenRound, RoundRecord
from server.coordinator.task_desk import TaskDesk

__all__ = ["RoundPhases"]

_log = logging.getLogger("fedps")


class RoundPhases:
    """Runs a round's commit and push phases with the key holder, the shards and the cohort.

    Parameters
    ----------
    peers
        The calls to the key holder and the shards.
    desk
        The clients' tasks and reports: shown the round in each phase.
    registry
        The clients: their signing keys, and who missed a deadline.
    policy
        Says when a commit phase is complete, and how many clients a push phase needs.
    timer
        The coordinator's phases of the round in progress.
    checkpoint
        Writes the coordinator's checkpoint with the round in progress (so that its cohort,
        its commitments and its deadline survive a restart).
    changed
        The condition that a client's call, a report or a stop notifies (the desk's).
    stop
        Set when the coordinator stops.
    deadline_s
        How long a push phase lasts.
    """

    def __init__(
        self,
        *,
        peers: ClusterPeers,
        desk: TaskDesk,
        registry: ClientRegistry,
        policy: RoundPolicy,
        timer: RoundTimer,
        checkpoint: Callable[[OpenRound], None],
        changed: threading.Condition,
        stop: threading.Event,
        deadline_s: float,
    ) -> None:
        self._peers = peers
        self._desk = desk
        self._registry = registry
        self._policy = policy
        self._timer = timer
        self._checkpoint = checkpoint
        self._changed = changed
        self._stop = stop
        self._deadline_s = deadline_s
        desk.ring = peers.ring  # the clients' tasks carry the ring

    def commit(self, opened: OpenRound, run_id: str) -> bool:
        """Open the commit phase at the key holder and collect commitments.

        Parameters
        ----------
        opened
            The round, with its cohort and commit deadline; its committed clients are set.
        run_id
            The run the round belongs to.

        Returns
        -------
        bool
            False when the key holder refused to open it (or the coordinator stopped
            meanwhile).
        """
        try:
            with self._timer.phase("open"):
                self._checkpoint(opened)  # the cohort and deadline survive a restart
                self._peers.check_shards()  # one gone since is off the ring the clients pull from
                self._peers.open_commits(self._opening(opened, opened.cohort, run_id))
        except FedPSError as exc:
            if not self._stop.is_set():
                # e.g. the key holder froze this round number for another cohort before a
                # restart lost our checkpoint: it can never take commitments again
                _log.warning("round %d cannot open: %s; abandoned", opened.round, exc)
            return False
        with self._timer.phase("commit_wait"):
            self._collect_commitments(opened)
        return True

    def _collect_commitments(self, opened: OpenRound) -> None:
        """Hand out TRAIN tasks and wait until the commit phase is complete, or its deadline.

        The round policy says when it is complete.
        """
        with self._changed:
            self._desk.open_round = opened
            self._changed.notify_all()
        try:
            while not self._stop.is_set() and time.time() < opened.deadline:
                with self._changed:
                    self._desk.recheck_commitments = False
                commitments = self._peers.commitments(opened.round, freeze=False)
                with self._changed:
                    opened.committed = frozenset(commitments.client_ids)
                    if commitments.frozen or self._policy.commitments_complete(  # frozen: restart
                        opened.cohort, opened.committed, opened.reported
                    ):
                        break
                    if not self._desk.recheck_commitments:  # else a member asked while we did
                        self._wait(opened)
        finally:
            with self._changed:
                self._desk.open_round = None
        self._mark_missed(opened, opened.cohort - opened.committed)

    def freeze(self, opened: OpenRound) -> tuple[frozenset[str], CommitSet]:
        """End ``opened``'s commit phase: no commitment is accepted after this.

        The clients the key holder blamed on evidence are excluded from the run.

        Parameters
        ----------
        opened
            The round at the end of its commit phase.

        Returns
        -------
        tuple[frozenset[str], CommitSet]
            The members of the cohort that committed, and the frozen commitments.
        """
        with self._timer.phase("freeze"):
            commitments = self._peers.commitments(opened.round, freeze=True)
        self._registry.exclude(commitments.excluded)  # blamed on evidence by the key holder
        return frozenset(commitments.client_ids) & opened.cohort, commitments

    def push(
        self,
        opened: OpenRound,
        committed: frozenset[str],
        commitments: CommitSet,
        *,
        run_id: str,
        resume: OpenRound | None,
        record: RoundRecord,
    ) -> set[str] | None:
        """Run the push phase for the ``committed`` clients; abandon the round short of quorum.

        The round is opened on the shards, the pushes are waited for, and the round is closed;
        there is no push phase when fewer than the policy's ``min_quorum`` committed. When
        fewer than ``min_quorum`` pushed all their blocks, the round is abandoned and the
        shards discard its sums: it is never decrypted.

        Parameters
        ----------
        opened
            The round, at the end of its commit phase.
        committed
            The clients that committed (those of the cohort): those that may push.
        commitments
            The frozen commitments the shards check the pushes against.
        run_id
            The run the round belongs to.
        resume
            The round as a restarted coordinator found it in its checkpoint, if it is that one.
        record
            The round's record: its contributors, its push phase's length, and whether it is
            abandoned are set.

        Returns
        -------
        set[str] | None
            The clients whose pushes are complete (None: stopping).

        Raises
        ------
        ShardStalledError
            A shard stalls the round: it waits in the checkpoint for a restart.
        """
        min_quorum = self._policy.min_quorum
        accepted: set[str] = set()
        if len(committed) >= min_quorum:
            pushed = self._push(opened, committed, commitments, run_id, resume, record)
            if pushed is None:
                return None  # stopping
            accepted = pushed
        record.contributors = len(accepted)
        if len(accepted) < min_quorum:
            _log.warning(
                "round %d abandoned: %d of %d clients committed, %d complete, quorum is %d",
                opened.round,
                len(committed),
                len(opened.cohort),
                len(accepted),
                min_quorum,
            )
            if opened.pushing:
                self._peers.discard_round(opened.round)
            record.abandoned = True
        return accepted

    def _push(
        self,
        opened: OpenRound,
        committed: frozenset[str],
        commitments: CommitSet,
        run_id: str,
        resume: OpenRound | None,
        record: RoundRecord,
    ) -> set[str] | None:
        """Open the round on the shards, wait for the pushes, close it (see :meth:`push`)."""
        opened.committed, opened.pushing = committed, True
        if resume is None or not resume.pushing:
            opened.deadline = time.time() + self._deadline_s
        self._checkpoint(opened)
        frozen_at = time.time()
        try:
            while True:
                try:
                    with self._timer.phase("shard_open"):
                        self._peers.open_round(
                            self._opening(opened, committed, run_id), commitments
                        )
                    with self._timer.phase("push_wait"):
                        self._wait_for_pushes(opened, resume)
                    if self._stop.is_set():
                        return None
                    with self._timer.phase("close"):
                        opened.closing = True
                        self._checkpoint(opened)
                        accepted = self._peers.close_round(opened.round, committed)
                    break
                except ShardGoneError as exc:
                    self.moved(opened, exc)
                    resume = None  # the push phase starts again on the new ring
        except ShardStalledError:
            raise
        except FedPSError as exc:
            if self._stop.is_set():
                return None
            _log.error("round %d: a shard keeps refusing it (%s); abandoned", opened.round, exc)
            return set()
        record.push_seconds = time.time() - frozen_at
        return accepted

    def moved(self, opened: OpenRound, gone: ShardGoneError) -> None:
        """Start ``opened``'s push phase again on the ring ``gone`` left (see the module)."""
        _log.warning(
            "round %d: %s; its push phase starts again on ring version %d",
            opened.round,
            gone,
            gone.view.version,
        )
        with self._changed:
            opened.reported.clear()  # every committed client pushes the moved blocks
            opened.closing = False
            opened.deadline = time.time() + self._deadline_s
            self._changed.notify_all()
        self._checkpoint(opened)  # the new ring survives a restart

    def _opening(self, opened: OpenRound, members: frozenset[str], run_id: str) -> CommitOpening:
        """``opened`` as the key holder or the shards open it, for ``members``."""
        return CommitOpening(
            opened.round,
            opened.version,
            run_id,
            self._desk.context_id,
            self._registry.signing_keys(members),
        )

    def _wait_for_pushes(self, opened: OpenRound, resume: OpenRound | None) -> None:
        """Wait until every committed client reported its push, or the push deadline."""
        with self._changed:
            self._desk.open_round = opened
            self._changed.notify_all()
            while (
                not self._stop.is_set()
                and time.time() < opened.deadline
                and not (resume is not None and resume.closing)
                and not opened.committed <= opened.reported
            ):
                self._wait(opened)
            self._desk.open_round = None
        self._mark_missed(opened, opened.committed)

    def _mark_missed(self, opened: OpenRound, expected: frozenset[str]) -> None:
        """Leave the members of ``expected`` that did not report out of cohorts.

        Once ``opened``'s deadline passed, they stay out until they ask for a task again (a dead
        client).
        """
        if not self._stop.is_set() and time.time() >= opened.deadline:
            self._registry.mark_missed(expected - opened.reported, deadline=opened.deadline)

    def _wait(self, opened: OpenRound) -> None:
        """Wait for a change (holding the lock), at most until ``opened``'s deadline."""
        self._changed.wait(timeout=min(RETRY_AFTER_S, max(0.0, opened.deadline - time.time())))
