"""Blame from evidence: after a failed check, who did it, proven, and nobody otherwise.

Two checks can fail on an aggregate that arrived well formed, and neither says by itself who
caused it:

- **The sketch check** (:class:`~.aggregate_verifier.AggregateVerifier`): the aggregate is not
  the sum of what its contributors committed, as their committed sketches tell. Either the
  shard changed the sum, or a contributor committed sketches that are not those of its own
  ciphertext (which would frame an honest shard). :meth:`Tracer.sketches` reveals the
  round's challenge (the round is refused for good) to the shard that sent the failing
  blocks and asks it for every contributor ciphertext that does not match its committed
  sketch. An honest shard's sum is the sum of what it was pushed, so it can always show one;
  the key holder checks each shown ciphertext against its client's signed root and its
  committed sketch: a real mismatch proves the client guilty; a shard that shows none, or
  shows a ciphertext that is not the committed one or that does match, is guilty.
- **The canary check** (:mod:`crypto.canary`): a decryption would carry key material, from a
  change to ``c1`` somewhere. :meth:`Tracer.canaries` asks the shard for each contributor's
  canary opening of the failing blocks (all of ``c1``, ``c0`` at the canaries, a digest of
  the rest: nothing of the values), checks each against its client's signed root, and
  computes each contributor's own canaries against the bound of one ciphertext: a
  contributor over it is guilty. If none is, a shard whose aggregate is not the sum of the
  openings is guilty; if it is, nobody is blamed (several contributors each under their own
  bound: the round is refused, nothing is decrypted).

A shard that does not answer is not blamed (that is a miss, not evidence); one that answers
with something a correct shard never sends is. :func:`judge` is the key holder's one call after
a failed check: it traces the failure, blames the guilty clients in
:class:`~.suspects.Suspects` and says whether the round is refused or summed again without them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from crypto import SecretContext
from crypto.canary import CanaryOpening, canary_bound, failing_rows
from crypto.signing import chunk_root
from crypto.sketch import Challenge
from fedps.errors import FedPSError, InvalidArgumentError, PeerUnavailableError, PolicyError
from fedps.rpc.shard_messages import TraceEvidence, TraceQuery
from fedps.rpc.shard_stub import ShardStub
from server.keyholder.aggregate_verifier import AggregateVerifier, TamperingError
from server.keyholder.commit_board import CommitPhase
from server.keyholder.decryptor import CanaryFailureError
from server.keyholder.shard_peers import ShardPeers
from server.keyholder.suspects import Suspects

__all__ = ["Tracer", "Verdict", "judge", "untraced_refusal"]

_log = logging.getLogger("fedps")

_CALL_S = 60.0


@dataclass
class Verdict:
    """Who a trace proved guilty: contributors with what they did, and a shard or None.

    The shard comes with its reason. Empty: nobody could be blamed on the evidence.
    """

    clients: dict[str, str] = field(default_factory=dict)
    shard: TamperingError | None = None

    def __bool__(self) -> bool:
        return bool(self.clients) or self.shard is not None


class Tracer:
    """Traces one round's failed check to whoever caused it.

    Parameters
    ----------
    round_
        The round.
    phase
        Its frozen commit phase (every contributor's signed roots and sketches).
    contributors
        The clients the aggregate was asked for, with their integer staleness multipliers.
    keys
        The key holder's secret context (canaries only: nothing is decrypted).
    unpack
        Validates packed ciphertext blocks into coefficient rows.
    """

    def __init__(
        self,
        round_: int,
        phase: CommitPhase,
        contributors: Mapping[str, int],
        keys: SecretContext,
        unpack: Callable[[list[bytes]], np.ndarray],
    ) -> None:
        self.round = round_
        self.phase = phase
        self.multipliers = dict(contributors)
        self.keys = keys
        self._unpack = unpack

    def _root(self, client: str, block: int) -> bytes:
        return self.phase.commitments[client].update.roots[block]

    def _ask(self, shard: ShardStub, query: TraceQuery) -> TraceEvidence | TamperingError | None:
        """The shard's evidence; None if it did not answer (not evidence).

        A TamperingError if it refused what it must hold.
        """
        try:  # a correct shard sends one item per contributor and block, at most
            limit = len(query.contributors) * len(query.blocks)
            return shard.trace_blocks(query, max_items=limit, timeout_s=_CALL_S)
        except PeerUnavailableError:
            return None
        except FedPSError as exc:
            return TamperingError(
                shard.shard_id, "evidence", f"refused to show the pushes it summed ({exc})"
            )

    def trace(
        self,
        failure: PolicyError,
        shards: Mapping[str, ShardStub],
        owner: Callable[[int], str],
        challenge: Challenge | None,
    ) -> Verdict:
        """Trace the failed check ``failure`` to whoever caused it.

        Failed canaries through the shards that own their blocks (:meth:`canaries`), a failed sketch
        through the shard that sent it (:meth:`sketches`, revealing ``challenge``); any other
        failure names nobody. ``owner``: the shard id of each block.
        """
        verdict = Verdict()
        if isinstance(failure, CanaryFailureError):
            for sid in sorted({owner(b) for b in failure.blocks}):
                found = self.canaries(
                    shards[sid], [b for b in failure.blocks if owner(b) == sid], failure.aggregates
                )
                verdict.clients.update(found.clients)
                verdict.shard = verdict.shard or found.shard
        elif _failed_sketch(failure):
            assert isinstance(failure, TamperingError) and challenge is not None
            verdict = self.sketches(shards[failure.shard], failure.blocks, challenge)
        return verdict

    def refusal(
        self, failure: PolicyError, verdict: Verdict, *, left: int, min_quorum: int
    ) -> PolicyError | None:
        """What to refuse the round with once ``verdict`` traced ``failure``, or None.

        A :class:`TamperingError` counts against its shard. None: try again without the guilty
        clients (only clients were guilty, of a canary that nothing revealed, and the ``left``
        others still make ``min_quorum``).
        """
        if verdict.shard is not None:
            return verdict.shard
        guilty = verdict.clients
        if guilty and isinstance(failure, CanaryFailureError) and left >= min_quorum:
            _log.warning(
                "round %d: summing the %d other contributors instead (nothing of the "
                "round was decrypted)",
                self.round,
                left,
            )
            return None
        if guilty:
            first = min(guilty)
            message = f"round {self.round}: {first} blamed ({guilty[first]})"
            return PolicyError(f"{message}; the round is refused")
        if _failed_sketch(failure):
            assert isinstance(failure, TamperingError)
            return PolicyError(
                f"round {self.round}: {failure.shard}'s aggregate failed its check and the shard "
                "showed no evidence (it did not answer); nobody is blamed, the round is "
                "refused"
            )
        return failure

    # ------------------------------------------------------------------ canaries
    def canaries(
        self, shard: ShardStub, blocks: Sequence[int], aggregates: Mapping[int, np.ndarray]
    ) -> Verdict:
        """Trace failed canaries of ``blocks``, all sent by ``shard``.

        ``aggregates``: each block's validated aggregate row, as checked.
        """
        clients = sorted(self.multipliers)
        query = TraceQuery(self.round, tuple(sorted(blocks)), tuple(clients))
        evidence = self._ask(shard, query)
        if evidence is None:
            return Verdict()
        if isinstance(evidence, TamperingError):
            return Verdict(shard=evidence)
        sid = shard.shard_id
        wanted = {(c, b) for c in clients for b in query.blocks}
        got = {(o.client_id, o.block): o for o in evidence.openings}
        if len(got) != len(evidence.openings) or set(got) != wanted:
            return Verdict(shard=TamperingError(sid, "evidence", "sent other openings than asked"))
        keys = [(c, b) for c in clients for b in query.blocks]
        try:
            openings = [got[k].opening() for k in keys]
            for (c, b), opening in zip(keys, openings, strict=True):
                if opening.root() != self._root(c, b):
                    raise InvalidArgumentError(f"{c!r}'s opening of block {b} is not committed")
            canaries = self.keys.opened_canaries(openings)
        except InvalidArgumentError as exc:
            return Verdict(shard=TamperingError(sid, "evidence", f"a false opening ({exc})"))
        # an opening shows the client's own ciphertext, not yet weighted by its multiplier:
        # the bound of one ciphertext (weighted by m, its canaries and their bound both grow m
        # times)
        bound = canary_bound(self.keys.public.params, 1.0)
        verdict = Verdict()
        for i in failing_rows(canaries, bound):
            client, block = keys[i]
            verdict.clients.setdefault(
                client, f"its ciphertext of block {block} carries key material (canaries)"
            )
        if verdict:
            return verdict
        for block in query.blocks:  # nobody alone: is the aggregate the sum of the openings?
            if not self._sums_match(block, keys, openings, aggregates[block]):
                return Verdict(
                    shard=TamperingError(
                        sid, "aggregate", f"block {block}'s aggregate is not its contributors' sum"
                    )
                )
        return verdict

    def _sums_match(
        self,
        block: int,
        keys: list[tuple[str, int]],
        openings: list[CanaryOpening],
        aggregate: np.ndarray,
    ) -> bool:
        """Whether ``aggregate`` agrees with the weighted sum of the block's openings.

        On everything they show: ``c1`` and the canaries of ``c0``.
        """
        q = self.keys.public.modulus
        n = self.keys.public.params.poly_modulus_degree
        step = len(aggregate) // 2 // len(self.keys.public.params.canary_positions)
        c1 = np.zeros(n, dtype=object)
        c0 = np.zeros(n // step, dtype=object)
        for (client, b), opening in zip(keys, openings, strict=True):
            if b != block:
                continue
            m = self.multipliers[client]
            c1 += opening.c1.astype(object) * m
            c0 += opening.c0_canaries.astype(object) * m
        shown = np.concatenate([c1 % q, c0 % q]).astype(np.uint64)
        actual = np.concatenate([aggregate[n:], aggregate[:n:step]])
        return bool(np.array_equal(shown, actual))

    # ------------------------------------------------------------------ sketches
    def sketches(self, shard: ShardStub, blocks: Sequence[int], challenge: Challenge) -> Verdict:
        """Trace a failed sketch check of ``blocks`` (all sent by ``shard``).

        It reveals the round's ``challenge`` to it (the round is never decrypted after this).
        """
        clients = sorted(self.multipliers)
        ordered = tuple(sorted(blocks))
        sketches = tuple(
            np.ascontiguousarray(self.phase.commitments[c].sketches[:, list(ordered)])
            .astype("<u8")
            .tobytes()
            for c in clients
        )
        query = TraceQuery(self.round, ordered, tuple(clients), challenge.seed, sketches)
        evidence = self._ask(shard, query)
        if evidence is None:
            return Verdict()
        if isinstance(evidence, TamperingError):
            return Verdict(shard=evidence)
        sid = shard.shard_id
        verdict = Verdict()
        for held in evidence.mismatches:
            if held.client_id not in self.multipliers or held.block not in ordered:
                return Verdict(shard=TamperingError(sid, "evidence", "showed a foreign push"))
            try:
                row = self._unpack([held.ciphertext])
            except InvalidArgumentError as exc:
                return Verdict(shard=TamperingError(sid, "evidence", f"showed garbage ({exc})"))
            if chunk_root(row[0]) != self._root(held.client_id, held.block):
                return Verdict(
                    shard=TamperingError(sid, "evidence", "showed a push its client never sent")
                )
            committed = self.phase.commitments[held.client_id].sketches[:, held.block]
            if np.array_equal(challenge.sketch(row)[:, 0], committed):
                return Verdict(
                    shard=TamperingError(sid, "evidence", "blamed a client whose sketch matches")
                )
            verdict.clients.setdefault(
                held.client_id,
                f"its committed sketch of block {held.block} is not its ciphertext's",
            )
        if not verdict:
            return Verdict(
                shard=TamperingError(
                    sid,
                    "aggregate",
                    f"blocks {list(ordered)[:5]}: the aggregate is not the sum of its "
                    "contributors' committed ciphertexts",
                )
            )
        return verdict


def judge(
    failure: PolicyError,
    verifier: AggregateVerifier,
    *,
    keys: SecretContext,
    unpack: Callable[[list[bytes]], np.ndarray],
    shards: ShardPeers,
    suspects: Suspects,
    min_quorum: int,
) -> tuple[PolicyError | None, set[str]]:
    """Trace the failed check ``failure`` to whoever caused it and blame the guilty clients.

    The guilty clients are blamed in ``suspects``. Then say whether to refuse the round (with
    which error: a :class:`TamperingError` counts against its shard) or to try again without the
    guilty clients (None: only clients were guilty, of a canary that nothing revealed, and the
    rest still make a quorum); with the guilty clients.

    Parameters
    ----------
    failure
        The failed check.
    verifier
        The check that failed: the round's frozen commit phase, its contributors (with their
        staleness multipliers) and its challenge.
    keys
        The key holder's secret context (canaries only: nothing is decrypted).
    unpack
        Validates packed ciphertext blocks into coefficient rows.
    shards
        Every shard, as the key holder calls it (the evidence is asked of them).
    suspects
        Where the guilty clients are blamed.
    min_quorum
        Fewest contributors a round may be decrypted with.
    """
    phase = verifier.phase
    tracer = Tracer(phase.round, phase, verifier.multipliers, keys, unpack)
    verdict = tracer.trace(failure, shards.clients, shards.owner, verifier.challenge)
    for client, why in sorted(verdict.clients.items()):
        suspects.blame(phase.round, client, why)
    guilty = set(verdict.clients)
    left = len(verifier.contributors - guilty)
    refusal = tracer.refusal(failure, verdict, left=left, min_quorum=min_quorum)
    return refusal, guilty


def untraced_refusal(failure: PolicyError, round_: int) -> PolicyError:
    """What to refuse ``round_`` with when ``failure`` cannot be traced (key-holder parties).

    A failed sketch is no evidence against its shard by itself: a contributor that committed
    sketches of another ciphertext than its own fails an honest shard's aggregate the same way,
    and only the trace tells them apart (:meth:`Tracer.sketches`). Untraced, it is refused as a
    :class:`PolicyError` that counts against nobody. Any other :class:`TamperingError` is proof
    in itself (the shard sent what a correct shard never sends) and is returned as it is.
    """
    if not _failed_sketch(failure):
        return failure
    assert isinstance(failure, TamperingError)
    _log.warning(
        "round %d: %s's aggregate failed its check; without a trace (key-holder parties) "
        "nobody is blamed",
        round_,
        failure.shard,
    )
    return PolicyError(
        f"round {round_}: {failure.shard}'s aggregate failed its check; a contributor's false "
        "sketch or the shard: without a trace nobody is blamed, the round is refused"
    )


def _failed_sketch(failure: PolicyError) -> bool:
    """Whether ``failure`` is a failed sketch check that names its blocks (traceable)."""
    return (
        isinstance(failure, TamperingError)
        and failure.reason == "aggregate"
        and bool(failure.blocks)
    )
