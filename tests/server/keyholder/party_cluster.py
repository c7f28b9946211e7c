"""Key-holder parties in process over one collective key, with the rounds they check."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from crypto.signing import BlockSigner
from fedps.errors import PeerUnavailableError
from fedps.rpc.keyholder_party_messages import DecryptionRequest, PartyCanaries
from server.keyholder.keyholder_party import KeyHolderParty
from tests.crypto.threshold_keys import Joint

MIN_QUORUM = 3
LAMBDA = 16
#: The clients of the tests' rounds.
COHORT = ("a", "b", "c", "d")


@dataclass
class Rounds:
    """The coordinator's closed sets and the shards' sums, as every party asks them."""

    closed: dict[int, frozenset[str]] = field(default_factory=dict)
    sums: dict[tuple[int, frozenset[str]], tuple[list[int], np.ndarray]] = field(
        default_factory=dict
    )
    asked: int = 0

    def add(self, round_: int, contributors: Collection[str], rows: np.ndarray) -> None:
        """Round ``round_`` closed with ``contributors``; the shards sum them to ``rows``."""
        self.closed[round_] = frozenset(contributors)
        self.sums[round_, frozenset(contributors)] = (list(range(len(rows))), rows)

    def closed_contributors(self, round_: int) -> frozenset[str]:
        """The set the coordinator closed ``round_`` with."""
        return self.closed[round_]

    def aggregate(self, round_: int, contributors: Collection[str]) -> tuple[list[int], np.ndarray]:
        """The shards' sums over exactly ``contributors``."""
        self.asked += 1
        return self.sums[round_, frozenset(contributors)]


class Switchable:
    """A party that can be taken down, brought back and restarted, as the combiner calls it."""

    def __init__(self, start: Callable[[], KeyHolderParty]) -> None:
        self._start = start
        self.party = start()
        self.up = True

    def restart(self) -> None:
        """A new process of the same party: its share, keys and state folder."""
        self.party = self._start()

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """The party's canaries, or :class:`PeerUnavailableError` while it is down."""
        self._answering()
        return self.party.canary_partial(request)

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """The party's partial, or :class:`PeerUnavailableError` while it is down."""
        self._answering()
        return self.party.partial_decrypt(request)

    def prepare(self, request: DecryptionRequest) -> bool:
        """The party prepares the round, or :class:`PeerUnavailableError` while it is down."""
        self._answering()
        return self.party.prepare(request)

    def _answering(self) -> None:
        if not self.up:
            raise PeerUnavailableError(f"party {self.party.index} does not answer")


def start_parties(
    joint: Joint, threshold: int, rounds: Rounds, combiner: BlockSigner, root: Path
) -> dict[int, Switchable]:
    """Every party of a fresh T-of-P dealing, each with its own state folder."""
    parties = {}
    shares = joint.shares(threshold)
    signers = {share.index: BlockSigner() for share in shares}
    keys = {index: signer.public_key for index, signer in signers.items()}
    for share in shares:
        folder = root / f"party-{share.index}"
        folder.mkdir()
        parties[share.index] = Switchable(
            partial(
                KeyHolderParty,
                share,
                joint.public,
                combiner_key=combiner.public_key,
                signer=signers[share.index],
                party_keys=keys,
                source=rounds,
                state_dir=folder,
                min_quorum=MIN_QUORUM,
                lambda_bits=LAMBDA,
            )
        )
    return parties
