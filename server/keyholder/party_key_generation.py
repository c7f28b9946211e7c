"""One party's side of the collective key generation: no process ever holds the whole key.

Party ``j`` of ``P`` (threshold ``T``), given the common seed every party agreed on:

1. :meth:`PartyKeyGeneration.start` draws its secret ``s_j`` and error, computes its public
   share ``b_j = -a s_j + e_j`` over the common ``a`` (:func:`crypto.threshold.common_polynomial`)
   and deals Shamir shares ``f_j(k)`` of ``s_j`` for every party ``k``, then forgets ``s_j``;
2. **commit before reveal**: every party's :attr:`~PartyKeyGeneration.commitment` (a hash of
   the seed, its index and ``b_j``) is handed to every other (:meth:`~PartyKeyGeneration.commit`)
   before any ``b_j`` or deal is given out: a party that dealt last could otherwise deal
   ``b_k = b' - sum of the others``, a key ``b' = -a s' + e'`` of its own, and hold alone the
   secret of the joint key every party computes (tests/security/test_party_rogue_key.py);
   :meth:`~PartyKeyGeneration.finish` checks every public share against its commitment;
3. every party's public share and the value dealt to this party by every party are handed to
   it (:meth:`~PartyKeyGeneration.receive`; over mutual TLS, between party certificates, each
   sender once);
4. :meth:`~PartyKeyGeneration.finish` sums what it was dealt into its key share and the public
   shares into the joint public key, and writes both into its folder: ``share.key`` (0600) and
   ``public.ctx``; every party computes the same public context, whose id the combiner is to
   check is the same at every party before it serves it to the clients. The values a party
   dealt stay in its memory until the object is dropped (the other parties may ask again).

Parties are honest but curious here: a party that deals inconsistent shares makes decryption
fail, it does not learn more (verifiable sharing of lattice secrets is not built).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from crypto import CkksParams, PublicContext
from crypto import threshold as th
from crypto.files import private_directory, write_atomic
from crypto.public_context import make_seal_context
from fedps.errors import InvalidArgumentError, NotReadyError, PolicyError

__all__ = ["PUBLIC_CONTEXT_FILE", "SHARE_FILE", "PartyKeyGeneration", "generate_in_one_process"]

SHARE_FILE = "share.key"
PUBLIC_CONTEXT_FILE = "public.ctx"
_COMMIT_DOMAIN = b"fedps-party-keygen-commit-v1"


class PartyKeyGeneration:
    """Party ``index``'s state in one collective key generation.

    Parameters
    ----------
    index
        This party's index in ``1..parties``.
    parties
        P.
    threshold
        T.
    params
        The scheme parameters of the joint key.
    seed
        The common seed every party agreed on (at least 16 bytes).
    """

    def __init__(
        self, index: int, *, parties: int, threshold: int, params: CkksParams, seed: bytes
    ) -> None:
        parms, _ = make_seal_context(params)
        self.modulus = int(parms.coeff_modulus()[0].value())
        if not 1 <= index <= parties or not 1 <= threshold <= parties:
            raise InvalidArgumentError(f"party {index} of {parties}, threshold {threshold}")
        self.index, self.parties, self.threshold = index, parties, threshold
        self.params = params
        self._seed = seed
        self._common = th.common_polynomial(seed, params.poly_modulus_degree, self.modulus)
        self._commitments: dict[int, bytes] = {}  # every party's, by index (its own included)
        self._public_share: np.ndarray | None = None
        self._dealt: dict[int, np.ndarray] = {}  # what this party deals, by receiver
        self._received: dict[int, np.ndarray] = {}  # what it was dealt, by sender
        self._public_shares: dict[int, np.ndarray] = {}

    def start(self) -> None:
        """Draw ``s_j``, compute ``b_j``, deal ``f_j(k)`` for every ``k``; forget ``s_j``."""
        drawn = th.draw_party_key(self._common, self.modulus)
        self._dealt = th.deal(
            drawn.secret, self.modulus, threshold=self.threshold, parties=self.parties
        )
        self._public_share = drawn.public_share
        self._commitments[self.index] = self._commitment_of(self.index, drawn.public_share)
        self.receive(self.index, public_share=drawn.public_share, dealt=self._dealt[self.index])

    @property
    def commitment(self) -> bytes:
        """The hash of ``b_j`` (with the seed and this party's index), for every party first."""
        if self.index not in self._commitments:
            raise NotReadyError(f"party {self.index} has not started the key generation")
        return self._commitments[self.index]

    def commit(self, sender: int, commitment: bytes) -> None:
        """Party ``sender``'s :attr:`commitment`, once (the same one again is ignored).

        Raises
        ------
        InvalidArgumentError
            An unknown sender, or another commitment than the one it gave before.
        """
        if not 1 <= sender <= self.parties or len(commitment) != hashlib.sha256().digest_size:
            raise InvalidArgumentError(f"party {self.index}: unexpected commitment of {sender}")
        if self._commitments.setdefault(sender, commitment) != commitment:
            raise InvalidArgumentError(f"party {sender} committed to two public shares")

    @property
    def public_share(self) -> np.ndarray:
        """``b_j``, for every party once every party's commitment is in."""
        self._require_commitments()
        assert self._public_share is not None
        return self._public_share

    def dealt_to(self, receiver: int) -> np.ndarray:
        """``f_j(receiver)``: only for party ``receiver``, over its authenticated channel.

        Only once every party's commitment is in (the deal carries ``b_j``).
        """
        if receiver not in self._dealt:
            raise NotReadyError(f"party {self.index} has nothing dealt to party {receiver}")
        self._require_commitments()
        return self._dealt[receiver]

    def _require_commitments(self) -> None:
        """Nothing of ``b_j`` leaves before every party committed to its own."""
        if self._public_share is None:
            raise NotReadyError(f"party {self.index} has not started the key generation")
        missing = sorted(set(range(1, self.parties + 1)) - set(self._commitments))
        if missing:
            raise NotReadyError(
                f"party {self.index} waits for the commitments of parties {missing}"
            )

    def _commitment_of(self, sender: int, public_share: np.ndarray) -> bytes:
        head = _COMMIT_DOMAIN + len(self._seed).to_bytes(4, "little") + self._seed
        body = sender.to_bytes(4, "little") + public_share.astype("<u8").tobytes()
        return hashlib.sha256(head + body).digest()

    def receive(self, sender: int, *, public_share: np.ndarray, dealt: np.ndarray) -> None:
        """Party ``sender``'s public share and the value it dealt to this party, once.

        Raises
        ------
        InvalidArgumentError
            An unknown sender, a second message from one, or values not below q.
        """
        if not 1 <= sender <= self.parties or sender in self._received:
            raise InvalidArgumentError(f"party {self.index}: unexpected deal from party {sender}")
        n = self.params.poly_modulus_degree
        for poly in (public_share, dealt):
            if poly.shape != (n,) or poly.dtype != np.uint64 or int(poly.max()) >= self.modulus:
                raise InvalidArgumentError(f"party {sender}'s deal is not N values below q")
        self._received[sender] = dealt
        self._public_shares[sender] = public_share

    def finish(self, directory: Path) -> tuple[th.KeyShare, PublicContext]:
        """The key share and the joint public context, written into ``directory``.

        Raises
        ------
        NotReadyError
            A party's deal is missing.
        PolicyError
            A party's public share is not the one it committed to: nothing is written.
        """
        missing = sorted(set(range(1, self.parties + 1)) - set(self._received))
        if missing:
            raise NotReadyError(f"party {self.index} waits for the deals of parties {missing}")
        self._require_commitments()
        for sender, public_share in sorted(self._public_shares.items()):
            if self._commitment_of(sender, public_share) != self._commitments[sender]:
                raise PolicyError(
                    f"party {sender}'s public share is not the one it committed to: "
                    "the key generation is refused"
                )
        share = th.KeyShare(
            self.index,
            self.threshold,
            self.parties,
            self.modulus,
            th.gather([self._received[k] for k in sorted(self._received)], self.modulus),
        )
        shares = [self._public_shares[k] for k in sorted(self._public_shares)]
        public_key = th.joint_public_key(self._common, shares, self.modulus)
        public = th.joint_public_context(self.params, public_key)
        private_directory(directory)
        share.save(directory / SHARE_FILE)
        write_atomic(directory / PUBLIC_CONTEXT_FILE, public.serialize())
        return share, public


def generate_in_one_process(
    params: CkksParams, *, parties: int, threshold: int, seed: bytes
) -> dict[int, PartyKeyGeneration]:
    """Every party's key generation in this process, shares exchanged; each ready to finish.

    What the party processes do over the network, for benchmarks and tests.
    """
    generations = {
        j: PartyKeyGeneration(j, parties=parties, threshold=threshold, params=params, seed=seed)
        for j in range(1, parties + 1)
    }
    for generation in generations.values():
        generation.start()
    for sender, source in generations.items():
        for target in generations.values():
            target.commit(sender, source.commitment)
    for sender, source in generations.items():
        for receiver, target in generations.items():
            if receiver != sender:
                target.receive(
                    sender, public_share=source.public_share, dealt=source.dealt_to(receiver)
                )
    return generations
