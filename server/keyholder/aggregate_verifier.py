"""The key holder's checks on what a shard hands it, before anything is decrypted.

A round's aggregates are checked against the commitments the key holder itself collected
before the round opened for pushes (:class:`server.keyholder.commit_board.CommitBoard`):

- **Exact contributor sets.** Every block's manifest names exactly the clients the round
  closed with, each of them committed, at least ``min_cohort`` and at most ``max_clients``;
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

from collections.abc import Callable

import numpy as np

from crypto.sketch import Challenge
from fedps.errors import PolicyError
from fedps.proto import common_pb2
from fedps.staleness import multiplier
from server.keyholder.commit_board import CommitPhase

__all__ = ["AggregateVerifier", "TamperingError"]


class TamperingError(PolicyError):
    """A shard handed the key holder something other than what the contributors committed."""

    def __init__(self, shard: str, reason: str, message: str) -> None:
        super().__init__(f"{shard}: {message} (tampering detected); refusing to decrypt")
        self.shard = shard
        self.reason = reason


class AggregateVerifier:
    """Checks one round's aggregates against the commitments of its contributors.

    Parameters
    ----------
    phase
        The round's frozen commit phase.
    contributors
        The clients the round closed with (each must have committed).
    challenge
        The round's challenge (None without encryption: no sketches to check).
    """

    def __init__(
        self,
        *,
        phase: CommitPhase,
        contributors: set[str],
        min_cohort: int,
        max_clients: int,
        challenge: Challenge | None,
        staleness: Callable[[int], float] | None = None,
        max_staleness: int = 0,
    ) -> None:
        missing = sorted(contributors - set(phase.commitments))
        if missing:
            raise PolicyError(f"round {phase.round}: {missing[:5]} never committed")
        if len(contributors) < min_cohort:
            raise PolicyError(
                f"round {phase.round}: {len(contributors)} contributors, policy needs at least "
                f"{min_cohort}; refusing to decrypt"
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

    def _multiplier(
        self,
        update: common_pb2.SignedUpdate,
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

    def check_update(self, shard: str, update: common_pb2.SignedUpdate) -> None:
        """A signed update a shard forwarded must be the committed one, if it is listed."""
        committed = self.phase.commitments.get(update.client_id)
        if committed is None or committed.update.SerializeToString(
            deterministic=True
        ) != update.SerializeToString(deterministic=True):
            raise TamperingError(
                shard, "manifest", f"forwarded an update of {update.client_id!r} never committed"
            )

    def check_manifest(self, shard: str, agg: common_pb2.AggregateBlock) -> None:
        """The block's contributors are exactly the round's, with their committed entries."""
        ids = [c.client_id for c in agg.contributions]
        if len(set(ids)) != len(ids) or set(ids) != self.contributors:
            raise TamperingError(
                shard,
                "manifest",
                f"block {agg.block} lists {len(ids)} contributions, not exactly the "
                f"{len(self.contributors)} clients the round closed with",
            )
        for c in agg.contributions:
            update = self.phase.commitments[c.client_id].update
            if (
                agg.block >= len(update.roots)
                or update.roots[agg.block] != c.root
                or c.weight != update.weight
                or c.version != update.version
                or c.multiplier != self.multipliers[c.client_id]
            ):
                raise TamperingError(
                    shard,
                    "manifest",
                    f"block {agg.block}: {c.client_id!r}'s entry differs from its commitment",
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
        """Every aggregate's sketch (``coefficients``: their validated rows) must equal the
        contributors' combined sketch of its block; ``owners[i]`` sent ``blocks[i]``."""
        if self.challenge is None:
            return
        actual = self.challenge.sketch(coefficients)
        wanted = expected[:, blocks]
        bad = np.nonzero(np.any(actual != wanted, axis=0))[0]
        if bad.size:
            i = int(bad[0])
            raise TamperingError(
                owners[i],
                "aggregate",
                f"block {blocks[i]}'s aggregate is not the sum of its contributors' committed "
                "ciphertexts",
            )
