"""The key holder's checks on what a shard hands it, before anything is decrypted.

A round's aggregates are checked against the commitments the key holder itself collected
before the round opened for pushes (:class:`server.keyholder.commit_board.CommitBoard`), all
in one call, :meth:`AggregateVerifier.verify`, as each shard's reply streams in:

- **Well-formed replies.** Each block comes from the shard that owns it, once, at the exact
  packed size; every signed update a shard forwards is the committed one; no block is missing.

- **Exact contributor sets.** Every block's manifest names exactly the clients the round
  closed with, each of them committed, at least ``min_quorum`` and at most ``max_clients``;
  each entry carries the committed root, weight and trained version, and the staleness
  multiplier recomputed here.
- **The whole aggregate.** Every block's aggregate (every coefficient of both polynomials) must
  have the sketch that the contributors' committed sketches add up to under the round's secret
  challenge (:class:`crypto.sketch.Challenge`): a shard that changes anything it was not given
  (one coefficient, a block, one client's ciphertext in place of the sum, a multiple of it, a
  sub-cohort) passes with probability at most 2^-40.

A failed check raises :class:`TamperingError`, naming the shard that sent the block and the
reason; the key holder then never decrypts that round.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from crypto.signed_update import SignedUpdate
from crypto.sketch import Challenge
from fedps.errors import InvalidArgumentError, PolicyError
from fedps.learning.staleness import multiplier
from fedps.rpc.messages import Aggregate, MalformedReplyError
from fedps.rpc.shard_messages import AggregatePart
from server.keyholder.commit_board import CommitPhase

__all__ = ["AggregateVerifier", "TamperingError"]


class TamperingError(PolicyError):
    """A shard handed the key holder something other than what the contributors committed."""

    def __init__(self, shard: str, reason: str, message: str, blocks: tuple[int, ...] = ()) -> None:
        super().__init__(f"{shard}: {message} (tampering detected); refusing to decrypt")
        self.shard = shard
        self.reason = reason
        #: the failing blocks, where the check knows them (a failed sketch)
        self.blocks = blocks


class AggregateVerifier:
    """Checks one round's aggregates against the commitments of its contributors.

    Parameters
    ----------
    phase
        The round's frozen commit phase.
    contributors
        The clients the round closed with (each must have committed).
    min_quorum
        Fewest contributors the round may be decrypted with.
    max_clients
        Most contributors one aggregate may sum (the CKKS parameters are sized for them).
    challenge
        The round's challenge (None without encryption: no sketches to check).
    staleness
        The staleness function of asynchronous mode (None: synchronous rounds, every update
        trained on the round's version).
    max_staleness
        The oldest model version, in versions behind, an asynchronous update may train.
    pad_seeds
        Each cohort member's pad seed of the round (:mod:`crypto.blinding`); empty without
        encryption.
    """

    def __init__(
        self,
        *,
        phase: CommitPhase,
        contributors: set[str],
        min_quorum: int,
        max_clients: int,
        challenge: Challenge | None,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
        pad_seeds: Mapping[str, bytes] | None = None,
    ) -> None:
        missing = sorted(contributors - set(phase.commitments))
        if missing:
            raise PolicyError(f"round {phase.round}: {missing[:5]} never committed")
        if len(contributors) < min_quorum:
            raise PolicyError(
                f"round {phase.round}: {len(contributors)} contributors, policy needs at least "
                f"{min_quorum}; refusing to decrypt"
            )
        if len(contributors) > max_clients:
            raise PolicyError(
                f"round {phase.round}: {len(contributors)} contributors, but the CKKS parameters "
                f"are sized for at most {max_clients} (he.max_clients)"
            )
        self.phase = phase
        self.contributors = contributors
        self.challenge = challenge
        self.multipliers = {
            c: self._multiplier(phase.commitments[c].update, staleness, max_staleness)
            for c in contributors
        }
        self.weights = {c: phase.commitments[c].update.weight for c in contributors}
        self._pad_seeds = dict(pad_seeds or {})

    def pads(self) -> list[tuple[bytes, int]]:
        """The contributors' pad seeds with their multipliers: what the aggregate's pads sum.

        Raises
        ------
        PolicyError
            A contributor has no pad seed (it was not in the round's cohort).
        """
        missing = sorted(c for c in self.contributors if c not in self._pad_seeds)
        if missing:
            raise PolicyError(f"round {self.phase.round}: no pad seed for {missing[:5]}")
        return [(self._pad_seeds[c], self.multipliers[c]) for c in sorted(self.contributors)]

    def _multiplier(
        self,
        update: SignedUpdate,
        staleness: Callable[[int], float] | None,
        max_staleness: int,
    ) -> int:
        age = self.phase.version - update.version
        if staleness is None:
            if age != 0:
                raise PolicyError(f"{update.client_id!r} trained another version")
            return 1
        if not 0 <= age <= max_staleness:
            raise PolicyError(f"{update.client_id!r}'s update is too stale")
        return multiplier(staleness, age)

    def verify(
        self,
        fetched: Mapping[str, Iterable[AggregatePart]],
        *,
        owner: Callable[[int], str],
        num_blocks: int,
        block_sizes: Collection[int],
        unpack: Callable[[list[bytes]], np.ndarray],
    ) -> tuple[list[int], np.ndarray]:
        """Check a whole round as each shard's reply streams in.

        Returns every block and its validated coefficients (one row each), for decryption.

        ``fetched`` maps each shard to its streamed reply, ``owner`` gives a block's shard on
        the ring, ``block_sizes`` are the lengths a packed block may have, ``unpack``
        validates packed aggregates into coefficient rows. Each block is
        checked before the next message is read, so a shard cannot make the key holder hold
        more than one small aggregate per block.

        Once a shard's reply has arrived, its blocks are unpacked and sketched on a worker
        thread while the next shard's reply streams in (one thread per shard, as many as the
        machine has cores); nothing is decrypted here. Which check fails first, and the error
        raised, are those of checking every shard one after the other (:meth:`_check_all`).

        Raises
        ------
        TamperingError
            Anything a correct shard would not send: nothing is to be decrypted.
        """
        expected = self.expected_sketches() if self.challenge is not None else None
        received: dict[str, list[Aggregate]] = {}
        early: dict[str, Future[np.ndarray | None]] = {}
        workers = max(1, min(len(fetched), os.cpu_count() or 1))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="verify")
        try:
            for sid, parts in fetched.items():
                received[sid] = aggs = self._receive(sid, parts, owner, num_blocks, block_sizes)
                if aggs:
                    early[sid] = pool.submit(self._check_shard, aggs, unpack, expected)
            owners = [sid for sid, aggs in received.items() for _ in aggs]
            blocks = [agg.block for aggs in received.values() for agg in aggs]
            missing = sorted(set(range(num_blocks)) - set(blocks))
            if missing:
                raise TamperingError(
                    owner(missing[0]), "missing-block", f"no aggregate for blocks {missing[:10]}"
                )
            rows = [future.result() for future in early.values()]
        finally:  # nothing runs on after a failure: the caller may trace it at once
            pool.shutdown(wait=True, cancel_futures=True)
        if any(r is None for r in rows):  # a shard failed a check: name it as in order
            return blocks, self._check_all(received, owners, blocks, unpack, expected)
        return blocks, np.concatenate([r for r in rows if r is not None])

    def _check_shard(
        self,
        aggs: list[Aggregate],
        unpack: Callable[[list[bytes]], np.ndarray],
        expected: np.ndarray | None,
    ) -> np.ndarray | None:
        """One shard's validated coefficients, if its blocks pass both checks; else None.

        The checks are unpacking and the sketch against ``expected`` (every block's combined
        sketch). A failure is named later, in shard order, by :meth:`_check_all`.
        """
        try:
            rows = unpack([agg.ciphertext for agg in aggs])
        except InvalidArgumentError:
            return None
        if expected is not None:
            assert self.challenge is not None
            blocks = [agg.block for agg in aggs]
            if np.any(self.challenge.sketch(rows) != expected[:, blocks]):
                return None
        return rows

    def _check_all(
        self,
        received: Mapping[str, list[Aggregate]],
        owners: list[str],
        blocks: list[int],
        unpack: Callable[[list[bytes]], np.ndarray],
        expected: np.ndarray | None,
    ) -> np.ndarray:
        """Every shard's blocks unpacked, then every sketch checked, one shard after the other.

        Returns the validated coefficients; ``owners[i]`` sent ``blocks[i]``.

        Raises
        ------
        TamperingError
            The first shard, in order, that sent a malformed block; else the shard of the first
            block whose sketch is wrong.
        """
        # Validate and unpack each shard's aggregates at once (vectorised; a malformed block
        # is blamed on the shard that sent it).
        rows: list[np.ndarray] = []
        for sid, aggs in received.items():
            if not aggs:
                continue
            try:
                rows.append(unpack([agg.ciphertext for agg in aggs]))
            except InvalidArgumentError as exc:
                raise TamperingError(sid, "malformed", f"malformed aggregate: {exc}") from exc
        coefficients = np.concatenate(rows)
        if expected is not None:
            self.check_aggregates(owners, blocks, coefficients, expected)
        return coefficients

    def _receive(
        self,
        sid: str,
        parts: Iterable[AggregatePart],
        owner: Callable[[int], str],
        num_blocks: int,
        block_sizes: Collection[int],
    ) -> list[Aggregate]:
        """One shard's aggregates, each checked as it arrives.

        The checks are ownership, duplicates, size, manifest, forwarded updates.
        """
        got: dict[int, Aggregate] = {}
        try:
            for part in parts:
                for update in part.updates:
                    self.check_update(sid, update)
                for agg in part.blocks:
                    if not 0 <= agg.block < num_blocks or owner(agg.block) != sid:
                        raise TamperingError(sid, "foreign-block", f"sent block {agg.block}")
                    if agg.block in got:
                        raise TamperingError(
                            sid, "duplicate-block", f"sent block {agg.block} twice"
                        )
                    if len(agg.ciphertext) not in block_sizes:
                        raise TamperingError(
                            sid,
                            "malformed",
                            f"block {agg.block} is not {' or '.join(map(str, sorted(block_sizes)))}"
                            " bytes",
                        )
                    self.check_manifest(sid, agg)  # before holding it: a few bytes per client
                    got[agg.block] = agg
        except MalformedReplyError as exc:
            raise TamperingError(sid, "manifest", str(exc)) from exc
        return list(got.values())

    def check_update(self, shard: str, update: SignedUpdate) -> None:
        """A signed update a shard forwarded must be the committed one, if it is listed."""
        committed = self.phase.commitments.get(update.client_id)
        if committed is None or committed.update != update:
            raise TamperingError(
                shard, "manifest", f"forwarded an update of {update.client_id!r} never committed"
            )

    def check_manifest(self, shard: str, agg: Aggregate) -> None:
        """The block's contributors are exactly the round's, with their committed entries."""
        if set(agg.contributions) != self.contributors:
            raise TamperingError(
                shard,
                "manifest",
                f"block {agg.block} lists {len(agg.contributions)} contributions, not exactly "
                f"the {len(self.contributors)} clients the round closed with",
            )
        for client_id, c in agg.contributions.items():
            update = self.phase.commitments[client_id].update
            if (
                agg.block >= len(update.roots)
                or update.roots[agg.block] != c.root
                or c.weight != update.weight
                or c.version != update.version
                or c.multiplier != self.multipliers[client_id]
            ):
                raise TamperingError(
                    shard,
                    "manifest",
                    f"block {agg.block}: {client_id!r}'s entry differs from its commitment",
                )

    def expected_sketches(self) -> np.ndarray:
        """What every block's aggregate must sketch to: (sketch count, blocks)."""
        assert self.challenge is not None
        return self.challenge.combine(
            [
                (self.phase.commitments[c].sketches, self.multipliers[c])
                for c in sorted(self.contributors)
            ]
        )

    def check_aggregates(
        self,
        owners: list[str],
        blocks: list[int],
        coefficients: np.ndarray,
        expected: np.ndarray,
    ) -> None:
        """Check every aggregate's sketch against the contributors' combined sketch of its block.

        They must be equal. ``coefficients`` are their validated rows; ``owners[i]`` sent
        ``blocks[i]``.
        """
        if self.challenge is None:
            return
        actual = self.challenge.sketch(coefficients)
        wanted = expected[:, blocks]
        bad = np.nonzero(np.any(actual != wanted, axis=0))[0]
        if bad.size:
            shard = owners[int(bad[0])]
            failing = tuple(blocks[int(i)] for i in bad if owners[int(i)] == shard)
            raise TamperingError(
                shard,
                "aggregate",
                f"block {failing[0]}'s aggregate is not the sum of its contributors' committed "
                "ciphertexts",
                failing,
            )
