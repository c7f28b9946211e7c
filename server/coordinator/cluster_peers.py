"""The coordinator's calls to the key holder and the shards, in one place.

:class:`ClusterPeers` calls them through their typed clients
(:class:`~fedps.rpc.keyholder_stub.KeyHolderStub`, :class:`~fedps.rpc.shard_stub.ShardStub`)
with the plain records of :mod:`fedps.rpc.keyholder_messages` and :mod:`fedps.rpc.shard_messages`.
Every call has a deadline (a call caught in a peer's restart fails and is retried, never
hangs) and is retried while the peer is unavailable until it succeeds or the coordinator
stops; a shard that refuses to open or close a round (it answers, with an error) is asked
:data:`REFUSALS` times, then the round is abandoned with that error. A shard that does not
answer opening or closing a round within ``security.shard_deadline_s`` misses its deadline
(:class:`~server.shard_misses.ShardMisses`); after ``security.max_shard_misses`` misses in
a row it is not asked again: :class:`~fedps.errors.ShardStalledError` names it. A round is
opened and closed on every shard at once, each shard's call run to its end.

The shards are those on the ring (:class:`~.ring_keeper.RingKeeper`): a shard that stays
unreachable for ``cluster.shard_gone_after_s`` is declared gone, its call raises
:class:`~.ring_keeper.ShardGoneError` with the new ring, and every later call goes to the shards
left, each carrying the ring (the key holder's and the shards' calls alike).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TypeVar

import numpy as np

from crypto.signing import model_verifier
from fedps.config import ClusterConfig
from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    PolicyError,
    ShardStalledError,
)
from fedps.rpc import keyholder_messages as records
from fedps.rpc.fan_out import fan_out
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.messages import ParameterBlock
from fedps.rpc.model_reader import ModelReader
from fedps.rpc.shard_messages import ClosedRound, RoundOpening, ShardStatus
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import batched, call_until
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.ring_view import RingView
from server.coordinator.ring_keeper import RING_FILE, RingKeeper, ShardGoneError
from server.shard_misses import ShardMisses

__all__ = ["REFUSALS", "ClusterPeers"]

_log = logging.getLogger("fedps")

_T = TypeVar("_T")

#: Times a shard may refuse opening or closing a round before the round is abandoned
REFUSALS = 5


class ClusterPeers:
    """The key holder and the shards, as the coordinator calls them.

    Parameters
    ----------
    cluster
        The addresses of the key holder and the shards.
    stop
        Set when the coordinator stops: ends every retry loop.
    misses
        Counts the shards' missed deadlines of opening and closing rounds (each call is made
        with its ``deadline_s``).
    """

    def __init__(
        self, cluster: ClusterConfig, *, stop: threading.Event, misses: ShardMisses
    ) -> None:
        self._stop = stop
        self._misses = misses
        self._params = ModelReader(dict(zip(cluster.shard_ids, cluster.shards, strict=True)))
        self._keyholder = KeyHolderStub(cluster.keyholder)
        #: the shard ring: which shards are on it, and its moves
        self.ring = RingKeeper(
            cluster.ring_ids,
            gone_after_s=cluster.shard_gone_after_s,
            known=cluster.shard_ids,
            check_empty=self._check_empty,
            path=cluster.state_dir / "coordinator" / RING_FILE,
            stop=stop,
        )
        self._round_ring: RingView | None = None  # the ring the round was opened on (shards)

    def _ring_shards(self) -> dict[str, ShardStub]:
        """The shards on the ring now, by shard id."""
        return {sid: self._params.shards[sid] for sid in self.ring.view.nodes}

    def retry(
        self,
        fn: Callable[[], _T],
        what: str,
        retry_on: type[FedPSError] | Callable[[FedPSError], bool] = FedPSError,
    ) -> _T:
        """Call until it succeeds (or the coordinator stops), retrying ``retry_on`` errors.

        ``retry_on`` is a class, or a predicate.
        """
        return call_until(fn, what, retry_on=retry_on, stop=self._stop)

    def _on_every_shard(
        self, call: str, fn: Callable[[ShardStub, float], _T], what: str
    ) -> dict[str, _T]:
        """``fn(shard, deadline_s)``, the RPC ``call``, on every shard at once (:meth:`_bounded`).

        Returns each shard's answer by shard id.
        """
        return fan_out(
            {
                sid: partial(self._bounded, sid, call, partial(fn, shard), f"{what} on {sid}")
                for sid, shard in self._ring_shards().items()
            }
        )

    def _bounded(self, shard: str, call: str, fn: Callable[[float], _T], what: str) -> _T:
        """Call ``fn(deadline_s)``, the RPC ``call`` to ``shard``, until it succeeds.

        An unavailable shard is asked again (until the coordinator stops, it is declared gone:
        :class:`ShardGoneError`, or its misses reach the limit: :class:`ShardStalledError`), any
        other error is retried :data:`REFUSALS` times, then raised.
        """
        deadline_s = self._misses.deadline_s
        gone: list[ShardGoneError] = []
        asked_at = [0.0]  # when the call now unanswered was made

        def ask() -> _T:
            asked_at[0] = self.ring.now()
            return self._misses.call(shard, call, lambda: fn(deadline_s))

        def ask_again(exc: FedPSError) -> bool:
            if not isinstance(exc, PeerUnavailableError | ShardStalledError):
                return False
            view = self.ring.unreachable(shard, asked_at[0])
            if view is not None:
                gone.append(ShardGoneError(f"{shard} is gone ({what})", view))
            return not gone and isinstance(exc, PeerUnavailableError)

        for attempt in range(1, REFUSALS + 1):
            try:
                answer = self.retry(ask, what, retry_on=ask_again)
                self.ring.answered(shard)
                return answer
            except (PeerUnavailableError, ShardStalledError) as exc:
                if gone:
                    raise gone[0] from exc
                raise  # stopping, or the shard stalls the run
            except FedPSError as exc:
                if attempt == REFUSALS or self._stop.wait(0.5 * attempt):
                    raise FedPSError(f"{what}: refused {attempt} times, last: {exc}") from exc
                _log.warning("%s: %s; retrying (%d of %d)", what, exc, attempt, REFUSALS)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ the key holder
    def model_state(self) -> records.ModelState:
        """The key holder's model state (waits for the key holder)."""
        return self.retry(self._keyholder.get_model_state, "key holder state")

    def public_context(self) -> records.PublicContextInfo:
        """The key holder's current context, its id and its model-signing key."""
        return self.retry(self._keyholder.get_public_context, "public context")

    def initialize(
        self, layout: BlockLayout, vector: np.ndarray, version: int, *, force: bool
    ) -> int:
        """Give the key holder the model ``vector`` at ``version`` (``force``: replace its own).

        Streamed in messages of about :data:`~fedps.rpc.transport.TARGET_MESSAGE_BYTES`, each
        naming the model's size: a model larger than gRPC's largest message (10M parameters
        are 40 MB) goes through too. Returns the version it publishes.
        """
        blocks = [
            ParameterBlock(b, version, layout.block_of(vector, b).astype("<f4").tobytes())
            for b in range(layout.num_blocks)
        ]
        uploads = [
            records.ModelUpload(
                layout.num_params,
                tuple(batch),
                force=force,
                version=version,
                **self.ring.view.fields(),
            )
            for batch in batched(blocks, lambda block: len(block.values))
        ]
        state = self.retry(lambda: self._keyholder.initialize_model(uploads), "initialise model")
        return state.version

    def open_commits(self, opening: records.CommitOpening) -> None:
        """Open a round's commit phase at the key holder for ``opening.members``.

        Raises
        ------
        FedPSError
            If the key holder refuses (e.g. it froze this round for another cohort).
        """
        opening = replace(opening, **self.ring.view.fields())  # its clients pull from this ring
        self.retry(
            lambda: self._keyholder.open_commits(opening),
            f"open commitments of round {opening.round}",
            retry_on=PeerUnavailableError,
        )

    def commitments(self, round_: int, *, freeze: bool) -> records.CommitSet:
        """Who committed to ``round_`` so far; with ``freeze``, accept no commitment after."""
        what = "freeze commitments" if freeze else "commitments"
        closing = records.CommitClosing(round_, freeze)
        return self.retry(
            lambda: self._keyholder.close_commits(closing), f"{what} of round {round_}"
        )

    def apply_round(self, application: records.RoundApplication) -> records.AppliedRound:
        """Ask the key holder to check, decrypt and apply exactly ``application.members``' sum.

        Every answer but a refusal is asked again until the coordinator stops: the key holder
        may have applied the round (it could not write its state, a shard did not take the
        new version, it restarted), and asking again applies it or returns its result and
        publishes it again; an applied round is never discarded. After each failure the
        shards on the ring are asked for their status (:meth:`_probe_ring`): one lost since
        the round closed is declared gone in time. If the key holder applied the round, it is
        asked again on the moved ring (it publishes the version there); if not, nothing was
        decrypted and :class:`ShardGoneError` sends the round back to its push phase.

        A refusal with a shard on the ring that the key holder quarantined (its proven
        tampering got the round refused) declares that shard gone: the round is pushed again
        without it (:class:`ShardGoneError`), and the key holder decrypts it from the others.

        Raises
        ------
        PolicyError
            The key holder refused the round (its checks failed; nothing was decrypted).
        ShardGoneError
            A shard was declared gone, or the operator removed one since the round opened on
            the shards (:meth:`_check_round_ring`), before the key holder applied the round.
        FedPSError
            The last error when the coordinator stopped.
        """
        gone: list[ShardGoneError] = []
        try:
            self._check_round_ring()  # the operator removed a shard since the round opened
        except ShardGoneError as moved:
            if self.model_state().last_round < application.round:
                raise
            _log.info("round %d is applied: %s", application.round, moved)

        def ask_again(exc: FedPSError) -> bool:
            if self._stop.is_set():
                return False
            if isinstance(exc, PolicyError) and not isinstance(exc, ShardStalledError):
                moved = self._quarantined_off_ring()
                if moved is not None:
                    gone.append(moved)  # refused for a shard on the ring: pushed without it
                return False
            try:
                self._probe_ring()
                self._check_round_ring()
            except ShardGoneError as moved:
                if self.model_state().last_round < application.round:
                    gone.append(moved)  # not applied: the round's pushes move with the ring
                    return False
                return True  # applied: asked again on the moved ring, it publishes there
            return not isinstance(exc, ShardStalledError)

        def ask() -> records.AppliedRound:  # on the ring now: it may move between attempts
            return self._keyholder.apply_round(replace(application, **self.ring.view.fields()))

        try:
            return self.retry(
                ask,
                f"apply round {application.round}",
                retry_on=ask_again,
            )
        except FedPSError as exc:
            if gone:
                raise gone[0] from exc
            raise

    def _quarantined_off_ring(self) -> ShardGoneError | None:
        """Declare gone the shards on the ring the key holder quarantined (on proof).

        The ring without them, as a :class:`ShardGoneError`; None if none was on it, or if the
        last shard is (no ring is left without it: the refusal stands).
        """
        quarantined = self.model_state().quarantined
        on_ring = sorted(set(quarantined) & set(self.ring.view.nodes))
        if not on_ring or self.ring.quarantined(quarantined):
            return None
        gone = ", ".join(on_ring)
        return ShardGoneError(f"{gone} is gone (quarantined on proof)", self.ring.view)

    def _check_round_ring(self) -> None:
        """Raise :class:`ShardGoneError` if the ring moved since the round opened on the shards.

        A shard declared gone while the round opens, is pushed to or closes moves the round
        itself (:meth:`_bounded`, :meth:`_probe_ring`); the operator removes one at any time
        (``RemoveShard``): the shards left then own blocks whose pushes went to the removed one.
        """
        opened, view = self._round_ring, self.ring.view
        if opened is not None and view.version != opened.version:
            raise ShardGoneError(
                f"the ring moved from version {opened.version} to {view.version} since the "
                "round opened",
                view,
            )

    def _probe_ring(self) -> None:
        """Ask every shard on the ring for its status once (each within its deadline).

        Raises
        ------
        ShardGoneError
            A shard that did not answer has been unreachable for ``cluster.shard_gone_after_s``:
            it is off the ring now.
        """

        def probe(sid: str, shard: ShardStub) -> None:
            asked_at = self.ring.now()
            try:
                shard.get_status(timeout_s=self._misses.deadline_s)
            except PeerUnavailableError:
                view = self.ring.unreachable(sid, asked_at)
                if view is not None:
                    raise ShardGoneError(f"{sid} is gone (after its round closed)", view) from None
                return  # silent: not gone yet
            except FedPSError:
                pass  # it answered, with an error
            self.ring.answered(sid)

        fan_out({sid: partial(probe, sid, shard) for sid, shard in self._ring_shards().items()})

    # ------------------------------------------------------------------ the shards
    def _check_empty(self, shard: str) -> None:
        """Whether ``shard``, which the operator adds to the ring, answers and is empty.

        Empty: it holds no published model and no round (a shard declared gone that came back
        is started with ``fedps shard --empty`` first, which sets its old state aside).

        Raises
        ------
        InvalidArgumentError
            ``shard`` holds a model or a round, or the key holder quarantined it.
        PeerUnavailableError
            ``shard`` does not answer.
        """
        if shard in self.model_state().quarantined:
            raise InvalidArgumentError(
                f"{shard} is quarantined (the key holder proved it tampered): it joins only "
                "once the operator replaced it and cleared the detections"
            )
        held = self._params.shards[shard].get_status(timeout_s=self._misses.deadline_s)
        if held.version or held.open_round:
            raise InvalidArgumentError(
                f"{shard} holds version {held.version} of the model and round {held.open_round}: "
                f"only an empty shard joins (start it with fedps shard --empty, which sets its "
                f"old state aside)"
            )

    def check_shards(self) -> None:
        """Ask every shard on the ring for its status until each answers or is declared gone.

        The shards the operator added join the ring first (:meth:`RingKeeper.admit_joins`). A
        round's clients pull the model from every shard on the ring: one gone since the last
        round is removed before they are sent to it (the ring moves on without it), and one
        that joined is published the model before they are (the key holder follows the ring
        when the round's commit phase opens).

        Raises
        ------
        ShardStalledError, FedPSError
            As :meth:`open_round` raises them.
        """
        self.ring.admit_joins()
        while True:
            try:
                self._on_every_shard("GetStatus", _status, "status")
                return
            except ShardGoneError:
                continue  # the shards left are asked again

    def open_round(self, opening: records.CommitOpening, commitments: records.CommitSet) -> None:
        """Open a round on every shard for ``opening.members`` and their commitments.

        Raises
        ------
        ShardStalledError
            A shard missed the deadline of opening it ``security.max_shard_misses`` times
            in a row.
        FedPSError
            A shard refused it :data:`REFUSALS` times, or the coordinator stopped.
        """
        members = opening.members
        self._round_ring = view = self.ring.view
        round_opening = RoundOpening(
            opening.round,
            opening.version,
            members,
            opening.context_id,
            opening.run_id,
            {u.client_id: u for u in commitments.updates if u.client_id in members},
            **view.fields(),
        )
        self._on_every_shard("OpenRound", partial(_open_round, opening=round_opening), "open round")

    def close_round(self, round_: int, cohort: frozenset[str]) -> set[str]:
        """Close ``round_`` on every shard; returns the clients whose pushes are complete.

        Those are the clients of ``cohort`` whose pushes every shard holding blocks found complete.

        Raises
        ------
        ShardStalledError
            A shard missed the deadline of closing it ``security.max_shard_misses`` times
            in a row.
        FedPSError
            A shard refused it :data:`REFUSALS` times, or the coordinator stopped.
        """
        closings = self._on_every_shard(
            "CloseRound", partial(_close_round, round_=round_), "close round"
        )
        accepted = set(cohort)
        for closed in closings.values():
            if closed.blocks:
                accepted &= set(closed.complete_clients)
        return accepted

    def discard_round(self, round_: int) -> None:
        """Discard ``round_``'s sums on every shard (one attempt each; a failure is logged)."""
        for sid, shard in self._ring_shards().items():
            try:
                shard.discard_round(round_)
            except FedPSError as exc:
                _log.warning("could not discard round %d on %s: %s", round_, sid, exc)

    def pull_model(
        self, layout: BlockLayout, min_version: int, signing_key: bytes | None
    ) -> np.ndarray:
        """The published model (one attempt).

        Every block's key-holder signature is checked against ``signing_key`` when there is one.
        """
        verify = model_verifier(signing_key) if signing_key is not None else None
        vector, _ = self._params.pull(layout, min_version, verify=verify, only=self.ring.view.nodes)
        return vector


def _open_round(shard: ShardStub, deadline_s: float, *, opening: RoundOpening) -> None:
    """Open a round on ``shard`` within ``deadline_s``."""
    shard.open_round(opening, timeout_s=deadline_s)


def _close_round(shard: ShardStub, deadline_s: float, *, round_: int) -> ClosedRound:
    """Close ``round_`` on ``shard`` within ``deadline_s``."""
    return shard.close_round(round_, timeout_s=deadline_s)


def _status(shard: ShardStub, deadline_s: float) -> ShardStatus:
    """``shard``'s status within ``deadline_s``."""
    return shard.get_status(timeout_s=deadline_s)
