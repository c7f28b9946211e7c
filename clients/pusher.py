"""A committed update on its way to the shards: wait for the push phase, push, resend.

An update goes to the shards only once the round's commitments are frozen and the shards have
opened the round (:meth:`Pusher.push_when_open` asks the coordinator until it says so).
Each shard gets the signed messages of the blocks it owns, every shard at once
(:meth:`Pusher.send`); a shard that refuses, whatever it answers, or keeps failing is counted
and skipped, and the others still get theirs: the round's close decides. The last committed
update is kept, so that a coordinator that asks for it again (after a failure cut the wait
short, or after it restarted before it saw the report) gets the same signed messages
(:meth:`Pusher.resend`), which the shards acknowledge as duplicates and count once.

The shard ring can move while a round is open (the coordinator removes a shard it declared gone),
or between the commitment and the push of an update trained before a shard joined: the push task
then carries the new ring, and the blocks the update sends to shards that no longer own them go to
their owners on it (:func:`moved_push`), the same committed ciphertexts. Asked again on a new
ring, a client pushes exactly those moved blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from clients.client_session import LONG_POLL_S, ClientSession, pause
from clients.peer_failures import PeerFailures
from clients.update_pipeline import PreparedPush, push_messages
from fedps.errors import FedPSError
from fedps.round_timer import RoundTimer
from fedps.rpc.coordinator_messages import Assignment
from fedps.rpc.fan_out import fan_out
from fedps.rpc.shard_messages import PushBatch
from fedps.sharding.hash_ring import HashRing

__all__ = ["Pusher", "moved_push"]

_log = logging.getLogger("fedps")


class Pusher:
    """Pushes a client's committed updates to the shards that own their blocks.

    Parameters
    ----------
    session
        The client's session: the shards' channels and the coordinator to ask.
    failures
        Where the shards' refusals are counted.
    timer
        Times the wait for the push phase (``barrier``) and the push (``push``).

    Attributes
    ----------
    bytes_pushed
        What the shards took over the run.
    push_seconds
        What the last push took.
    on_acknowledged
        Called with ``(round, shard id)`` each time a shard acknowledged its messages of a
        round, in the pushing thread once every shard answered (None: nothing is called).
    """

    def __init__(
        self, session: ClientSession, failures: PeerFailures, *, timer: RoundTimer | None = None
    ) -> None:
        self.session = session
        self.failures = failures
        self.timer = timer or RoundTimer()
        self._committed: tuple[str, PreparedPush] | None = None  # with the run it is of
        self.bytes_pushed = 0
        self.push_seconds = 0.0
        self.on_acknowledged: Callable[[int, str], None] | None = None

    @property
    def committed(self) -> PreparedPush | None:
        """The last update committed in the session's run (pushed or not).

        Pushed when the coordinator asks for it. None: none, or the coordinator runs another run
        now.
        """
        if self._committed is None or self._committed[0] != self.session.run_id:
            return None
        return self._committed[1]

    def keep(self, prepared: PreparedPush) -> None:
        """Keep ``prepared`` as the committed update, through a failure of what follows."""
        self._committed = (self.session.run_id, prepared)

    def push_when_open(self, prepared: PreparedPush) -> int:
        """:meth:`send` once the coordinator says the round is ready for pushes.

        That is, its commitments are frozen and the shards opened it. Returns bytes pushed (0: the
        round ended first).
        """
        self.push_seconds = 0.0
        session = self.session
        wait_s = session.config.training.deadline_s + session.peer_wait_s
        with self.timer.phase("barrier"):
            pushing = self.wait_for_push_phase(prepared.round, wait_s)
        if not pushing:
            _log.info("%s: round %d ended before its push phase", session.name, prepared.round)
            return 0
        with self.timer.phase("push"):
            return self.send(prepared)

    def wait_for_push_phase(self, round_: int, timeout_s: float) -> bool:
        """Wait for ``round_``'s push phase, after committing to it.

        It opens when the coordinator says the round's commitments are frozen and the shards take
        pushes. False: the round ended without a push phase, e.g. too few clients committed.
        """
        until = time.time() + timeout_s
        while time.time() < until:
            task = self.session.poll_task(
                retry_s=timeout_s, wait_s=LONG_POLL_S, committed_round=round_
            )
            if task.kind == "push" and task.round == round_:
                return True
            if task.kind == "done" or task.round > round_:
                return False
            pause(task)
        return False

    def send(self, prepared: PreparedPush) -> int:
        """Push committed messages to their shards now; returns bytes pushed.

        The round's commitments must be frozen and the shards have opened it. A shard that refuses
        or keeps failing counts no bytes (and a failure).
        """
        started = time.monotonic()
        prepared, _ = self._on_ring(prepared)
        total = self.push_all(prepared)
        self.push_seconds = time.monotonic() - started
        self.keep(prepared)
        self.bytes_pushed += total
        return total

    def resend(self, task: Assignment) -> bool:
        """Push again for a round we committed to, when asked.

        We are asked after a failure cut our wait for the push phase short, or again (the
        coordinator restarted before it saw our report). Push the same signed messages (shards
        acknowledge a repeat as a duplicate and count it once); returns True then, for the caller to
        report. False: nothing of ours in that round (what we committed was lost with a
        restart of this client).
        """
        committed = self.committed
        if committed is None or committed.round != task.round:
            _log.info(
                "%s: nothing to push for round %d (a restart lost what was committed); "
                "the round goes on without this client",
                self.session.name,
                task.round,
            )
            return False
        _, moved = self._on_ring(committed)
        self.push_all(committed if moved is None else moved)
        return True

    def _on_ring(self, prepared: PreparedPush) -> tuple[PreparedPush, PreparedPush | None]:
        """``prepared`` cut for the session's ring now (kept), and its moved blocks (None: none)."""
        ring = self.session.ring
        moved = moved_push(prepared, ring)
        if moved is None:
            return prepared, None
        whole = PreparedPush(prepared.round, prepared.version, _cut(prepared, ring, all_=True))
        self.keep(whole)
        return whole, moved

    def push_all(self, prepared: PreparedPush) -> int:
        """Push to every shard that owns a block; returns the bytes the shards took.

        Every shard is pushed to at once (:func:`~fedps.rpc.fan_out.fan_out`); once all have
        answered, :attr:`on_acknowledged` hears of each shard that acknowledged, one after the
        other, in this thread. A shard that refuses, whatever it answers, or keeps failing is
        counted, logged and skipped: the others still get theirs, and the round's close decides.
        """

        def attempt(sid: str, messages: list[PushBatch]) -> int | FedPSError:
            try:
                return self.push_to(sid, messages)
            except FedPSError as exc:
                return exc

        outcomes = fan_out(
            {sid: partial(attempt, sid, messages) for sid, messages in prepared.messages.items()}
        )
        total = 0
        for sid, outcome in outcomes.items():
            if isinstance(outcome, FedPSError):
                self.failures.failed(sid, outcome)
                continue
            total += outcome
            if self.on_acknowledged is not None and prepared.messages[sid]:
                self.on_acknowledged(prepared.messages[sid][0].round, sid)
        return total

    def push_to(self, sid: str, messages: list[PushBatch]) -> int:
        """Push messages to one shard, waiting out a restart; returns the bytes sent.

        The shard's log keeps what it acknowledged, so a retry after a lost acknowledgement is
        counted once.
        """
        shard = self.session.shards.shards[sid]
        return shard.push_blocks(messages, retry_s=self.session.peer_wait_s).sent_bytes


def moved_push(prepared: PreparedPush, ring: HashRing) -> PreparedPush | None:
    """The blocks ``prepared`` sends to shards that no longer own them on ``ring``.

    As messages to their owners on ``ring``: the blocks of a shard off the ring, and those a
    shard that joined took from another. The same committed ciphertexts under the same signed
    commitment. None: every block goes to its owner on ``ring``.
    """
    messages = _cut(prepared, ring, all_=False)
    return PreparedPush(prepared.round, prepared.version, messages) if messages else None


def _cut(prepared: PreparedPush, ring: HashRing, *, all_: bool) -> dict[str, list[PushBatch]]:
    """``prepared``'s blocks (``all_``; else only those whose owner changed) cut for ``ring``.

    Empty when no owner changed (and not ``all_``).
    """
    signed = next(m[0] for m in prepared.messages.values() if m and m[0].signature)
    by_owner: dict[str, list[tuple[int, bytes]]] = {}
    for sid, messages in prepared.messages.items():
        for message in messages:
            for block, data in message.blocks:
                owner = ring.owner(block)
                if all_ or owner != sid:
                    by_owner.setdefault(owner, []).append((block, data))
    return push_messages(signed.update, prepared.round, signed.context_id, by_owner)
