"""One party of a threshold key holder: a share of the key, and its own check of every round.

With ``P`` parties (:mod:`crypto.threshold`) no process holds the secret key; a combiner (the
key holder that verifies, holds the model and applies rounds) asks ``T`` parties for partial
decryptions of a round's aggregate and adds them to ``c0``. A party decrypts nothing it has
not checked itself, and trusts no single other role for it:

- the **contributor set** must be the one the coordinator closed the round with (asked of
  the coordinator, not taken from the combiner) and hold at least ``min_quorum`` clients: no
  one-client "aggregate", no sub-cohort;
- the **aggregate** is fetched from the shards by the party itself, summed by them over
  exactly that set; its digest must be the one the combiner signed, which the combiner signs
  only once the aggregate passed its own check against the clients' commitments (the secret
  sketch challenge is the combiner's): a shard that changed a sum and a combiner that lies
  about its check must collude to be believed;
- **zero canaries** (:mod:`crypto.joint_canary`): the participants first return their
  flooded canaries of random combinations of the blocks (:meth:`KeyHolderParty.canary_partial`,
  signed with each party's key); a partial decryption request carries every participant's,
  and the party checks their signatures, that its own are the ones it gave, and the combined
  canaries against the bound itself: a change to ``c1`` by a client or a shard, and no full
  partial leaves it;
- the aggregate fetched and checked for the canaries is the one the partial decryption that
  follows decrypts (the last one is kept, read-only, for the same round, set and digest);
- **prepared ahead, released after**: the combiner tells the participants of a round when it
  starts checking it (:meth:`KeyHolderParty.prepare`, signed); each fetches the aggregate,
  hashes it and computes its unflooded products meanwhile (:mod:`.party_prefetch`), and uses
  them only once a request passed every check above, for that very aggregate;
- **once per round**: a round's aggregate is answered for one digest only, at most
  ``2 P`` times (canaries and partials, retried with another set of parties after one went
  down), recorded durably before the answer leaves: no replay of a round with another
  aggregate, across restarts too.

Only then does the party return ``c1 (lambda_j sh_j) + e'_j`` of the aggregate it fetched
(never of bytes the combiner sent), flooded with :func:`crypto.threshold.flooding_std` for the
round's contributors (:class:`crypto.partial_decryptor.PartialDecryptor`: the product by
SEAL's NTT, the flooding drawn ahead after each round). Asynchronous rounds (weighted sums)
are not decrypted by parties: the party would need the staleness multipliers, checked
against the shards' manifests.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from crypto import PublicContext
from crypto.canary import CanaryError
from crypto.files import read_checked, write_checked
from crypto.joint_canary import COMBINATIONS, CanaryCheck
from crypto.partial_decryptor import PartialDecryptor
from crypto.signing import BlockSigner, verify_block
from crypto.threshold import KeyShare, aggregate_digest, flooding_std, prepare_digest
from fedps.errors import InvalidArgumentError, PolicyError
from fedps.rpc.keyholder_party_messages import DecryptionRequest, PartyCanaries
from server.keyholder.party_prefetch import PartyPrefetch, PreparedRound

__all__ = ["KeyHolderParty", "RoundSource"]

_log = logging.getLogger("fedps")

LEDGER_FILE = "decrypted.json"
_GIVEN_KEPT = 64  # canaries remembered for the partial decryptions that follow them


class RoundSource(Protocol):
    """What a party asks the other roles itself, never the combiner."""

    def closed_contributors(self, round_: int) -> frozenset[str]:
        """The clients the coordinator closed ``round_`` with."""
        ...

    def aggregate(self, round_: int, contributors: Collection[str]) -> tuple[list[int], np.ndarray]:
        """The shards' sums of ``round_`` over exactly ``contributors``: blocks, (B, 2N) rows."""
        ...


class KeyHolderParty:
    """Party ``share.index`` of a T-of-P key holder: checks a round, then decrypts its share.

    Parameters
    ----------
    share
        This party's share of the joint secret key.
    public
        The joint public context (the parameters of every aggregate).
    combiner_key
        The combiner's Ed25519 public key (32 bytes).
    signer
        This party's signing key (of its canary partials).
    party_keys
        Every party's Ed25519 public key, by index (this one's included).
    source
        The coordinator and the shards, as this party asks them.
    state_dir
        This party's folder: its ledger of the rounds it decrypted (the share's file too).
    min_quorum
        The fewest contributors of an aggregate it decrypts.
    lambda_bits
        The statistical security of its flooding (:func:`crypto.threshold.flooding_std`).
    """

    def __init__(
        self,
        share: KeyShare,
        public: PublicContext,
        *,
        combiner_key: bytes,
        signer: BlockSigner,
        party_keys: Mapping[int, bytes],
        source: RoundSource,
        state_dir: Path,
        min_quorum: int,
        lambda_bits: int,
    ) -> None:
        if share.modulus != public.modulus:
            raise InvalidArgumentError("the key share is not of this public context's modulus")
        if party_keys.get(share.index) != signer.public_key:
            raise InvalidArgumentError(f"party {share.index}'s listed key is not its signing key")
        self.share = share
        self.public = public
        self._decryptor = PartialDecryptor(share, public)
        self._combiner_key = combiner_key
        self._signer = signer
        self._party_keys = dict(party_keys)
        self._source = source
        self._min_quorum = min_quorum
        self._lambda_bits = lambda_bits
        self._ledger = _Ledger(state_dir / LEDGER_FILE)
        self._lock = threading.Lock()
        self._given: dict[bytes, bytes] = {}  # request digest -> the canaries it was given
        #: the last aggregate fetched and checked (with its products when prepared ahead):
        #: the partial that follows a round's canaries decrypts it without fetching it again
        self._fetched: PreparedRound | None = None
        self._prefetch = PartyPrefetch(self._prepare_round)

    @property
    def index(self) -> int:
        """The party's index in ``1..P``."""
        return self.share.index

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """The party's flooded canaries of the round's block combinations, signed.

        Raises
        ------
        PolicyError
            A check of the round failed (the message names it): nothing is computed.
        """
        fetched = self._checked(request)
        check = self._canary_check(
            len(request.contributors), request.aggregate, len(fetched.blocks)
        )
        n = self.public.params.poly_modulus_degree
        ahead = fetched.products_for(request.participants)
        with self._lock:
            self._ledger.admit(request.round, request.aggregate, limit=2 * self.share.parties)
            if ahead is not None and ahead.canaries is not None:
                values = check.flooded(ahead.canaries, self.share.modulus)
            else:
                values = check.partial(self.share, fetched.rows[:, n:], request.participants)
            unsigned = PartyCanaries(self.index, values.astype("<u8").tobytes(), b"")
            signature = self._signer.sign(unsigned.digest(request.digest()))
            self._given[request.digest()] = unsigned.canaries
            while len(self._given) > _GIVEN_KEPT:  # the oldest first (dicts keep order)
                del self._given[next(iter(self._given))]
        return PartyCanaries(self.index, unsigned.canaries, signature)

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """The party's flooded partial decryption of the round's aggregate, (B, N) uint64.

        Raises
        ------
        PolicyError
            A check failed (the message names it; a joint canary beyond the bound is a
            :class:`~crypto.canary.CanaryError`): nothing is decrypted.
        InvalidArgumentError
            The request is malformed (participants not ``T`` distinct parties with this one).
        """
        round_ = request.round
        fetched = self._checked(request)
        rows = fetched.rows
        n = self.public.params.poly_modulus_degree
        check = self._canary_check(
            len(request.contributors), request.aggregate, len(fetched.blocks)
        )
        self._check_canaries(request, rows, check)
        sigma = flooding_std(
            self.public.params,
            len(request.contributors),
            parties=self.share.parties,
            lambda_bits=self._lambda_bits,
        )
        with self._lock:  # the ledger is written before anything leaves
            self._ledger.admit(round_, request.aggregate, limit=2 * self.share.parties)
        _log.info(
            "party %d: partial decryption of round %d (%d contributors, parties %s)",
            self.index,
            round_,
            len(request.contributors),
            sorted(request.participants),
        )
        ahead = fetched.products_for(request.participants)
        if ahead is not None and ahead.product is not None:  # computed ahead, flooded now
            return self._decryptor.flooded(ahead.product, sigma=sigma)
        return self._decryptor.decrypt(rows[:, n:], participants=request.participants, sigma=sigma)

    def prepare(self, request: DecryptionRequest) -> bool:
        """Start fetching and computing ``request``'s round ahead; whether it started.

        ``request`` is the combiner's signed prepare (its ``aggregate`` empty, its signature
        of :func:`crypto.threshold.prepare_digest`). Nothing is released: the products are
        used only by requests that pass every check (:mod:`.party_prefetch`).

        Raises
        ------
        PolicyError
            The prepare is not signed by the combiner, lists a contributor twice or fewer
            than the minimum: nothing is fetched.
        InvalidArgumentError
            The participants are not ``T`` distinct parties with this one.
        """
        round_ = request.round
        self._check_participants(request)
        digest = prepare_digest(round_, request.contributors, request.participants)
        if not verify_block(self._combiner_key, digest, request.signature):
            raise PolicyError(f"round {round_}: the prepare is not signed by the combiner")
        contributors = self._checked_set(request)
        return self._prefetch.start(round_, contributors, request.participants)

    def wait_drawn(self, timeout_s: float) -> bool:
        """Wait until the next round's flooding is drawn, at most ``timeout_s``; whether so."""
        return self._decryptor.wait_drawn(timeout_s)

    def _checked(self, request: DecryptionRequest) -> PreparedRound:
        """The round's aggregate, fetched from the shards once every check of the request passed.

        Prepared ahead when the combiner said so (:meth:`prepare`), for this very aggregate.
        """
        round_ = request.round
        self._check_participants(request)
        if not verify_block(self._combiner_key, request.digest(), request.signature):
            raise PolicyError(f"round {round_}: the request is not signed by the combiner")
        contributors = self._checked_set(request)
        closed = self._source.closed_contributors(round_)
        if contributors != closed:
            raise PolicyError(
                f"round {round_}: the contributors asked for are not the {len(closed)} the "
                "coordinator closed the round with: not decrypted"
            )
        key = (round_, contributors)
        with self._lock:
            fetched = self._fetched
        if fetched is not None and (fetched.key, fetched.digest) == (key, request.aggregate):
            return fetched  # checked for its canaries: kept
        fetched = self._prefetch.take(round_, contributors)
        if fetched is None or fetched.digest != request.aggregate:  # not prepared, or another
            blocks, rows = self._source.aggregate(round_, sorted(contributors))
            rows.flags.writeable = False  # what was hashed is what is decrypted
            fetched = PreparedRound(key, blocks, rows, aggregate_digest(blocks, rows))
        if fetched.digest != request.aggregate:
            raise PolicyError(
                f"round {round_}: the shards' aggregate is not the one the combiner verified: "
                "not decrypted"
            )
        with self._lock:
            self._fetched = fetched
        return fetched

    def _check_participants(self, request: DecryptionRequest) -> None:
        participants = set(request.participants)
        if self.index not in participants or len(participants) != self.share.threshold:
            raise InvalidArgumentError(
                f"round {request.round}: a request names {self.share.threshold} distinct "
                f"parties, party {self.index} among them"
            )

    def _checked_set(self, request: DecryptionRequest) -> frozenset[str]:
        """The request's contributors, once none is listed twice and they are enough."""
        round_ = request.round
        contributors = frozenset(request.contributors)
        if len(contributors) != len(request.contributors):
            raise PolicyError(f"round {round_}: the request lists a contributor twice")
        if len(contributors) < self._min_quorum:
            raise PolicyError(
                f"round {round_}: {len(contributors)} contributors, fewer than the "
                f"minimum {self._min_quorum}: not decrypted"
            )
        return contributors

    def _prepare_round(
        self, round_: int, contributors: frozenset[str], participants: tuple[int, ...]
    ) -> PreparedRound:
        """What :meth:`prepare` computes on its thread: nothing of it leaves as it is."""
        closed = self._source.closed_contributors(round_)
        if contributors != closed:
            raise PolicyError(f"round {round_}: a prepare for another set than the closed one")
        blocks, rows = self._source.aggregate(round_, sorted(contributors))
        rows.flags.writeable = False
        digest = aggregate_digest(blocks, rows)
        c1 = rows[:, self.public.params.poly_modulus_degree :]
        share = self.share
        check = self._canary_check(len(contributors), digest, len(blocks))
        return PreparedRound(
            (round_, contributors),
            blocks,
            rows,
            digest,
            participants,
            canaries=check.product(share, c1, participants),
            product=self._decryptor.product(c1, participants=participants),
        )

    def _canary_check(self, contributors: int, aggregate: bytes, blocks: int) -> CanaryCheck:
        share = self.share
        return CanaryCheck(
            self.public.params, share.parties, share.threshold, contributors, aggregate, blocks
        )

    def _check_canaries(
        self, request: DecryptionRequest, rows: np.ndarray, check: CanaryCheck
    ) -> None:
        """Every participant's signed canaries, this party's own among them, within the bound."""
        round_, digest = request.round, request.digest()
        given = {c.party: c for c in request.canaries}
        if sorted(given) != sorted(request.participants) or len(given) != len(request.canaries):
            raise PolicyError(f"round {round_}: the request lacks a participant's canaries")
        for index, canaries in given.items():
            key = self._party_keys.get(index, b"")
            if not verify_block(key, canaries.digest(digest), canaries.signature):
                raise PolicyError(f"round {round_}: party {index}'s canaries are not signed by it")
        with self._lock:
            mine = self._given.get(digest)
        if mine is None or given[self.index].canaries != mine:
            raise PolicyError(
                f"round {round_}: the request's canaries of this party are not its own"
            )
        n = self.public.params.poly_modulus_degree
        partials = [given[j].values(COMBINATIONS) for j in sorted(given)]
        try:
            check.verify(rows[:, :n], partials, self.share.modulus)
        except CanaryError as exc:
            _log.warning("party %d: round %d refused: %s", self.index, round_, exc)
            raise


class _Ledger:
    """The rounds a party decrypted: each with its aggregate's digest and how many partials.

    Written (checked format, 0600, atomically) before a partial leaves the party.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        data = read_checked(path, what="the party's ledger", hint="restore it from a backup")
        entries = json.loads(data) if data is not None else {}
        self._rounds: dict[int, tuple[str, int]] = {
            int(r): (str(d), int(c)) for r, (d, c) in entries.items()
        }

    def admit(self, round_: int, digest: bytes, *, limit: int) -> None:
        """Record one more answer about ``round_``'s aggregate ``digest``, or refuse it.

        Raises
        ------
        PolicyError
            The round was decrypted with another aggregate, or ``limit`` times already.
        """
        seen, count = self._rounds.get(round_, (digest.hex(), 0))
        if seen != digest.hex():
            raise PolicyError(
                f"round {round_} was answered for another aggregate: a round is decrypted once"
            )
        if count >= limit:
            raise PolicyError(f"round {round_} was answered {count} times already")
        self._rounds[round_] = (seen, count + 1)
        payload = {str(r): [d, c] for r, (d, c) in sorted(self._rounds.items())}
        write_checked(self._path, json.dumps(payload).encode())
