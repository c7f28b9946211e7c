"""The combiner's side of threshold decryption: ask ``T`` parties, add their partials to ``c0``.

:class:`JointDecryptor` signs a request for a verified aggregate
(:class:`~.keyholder_party.DecryptionRequest`), asks a set of ``T`` parties that are up (all at
once, each from its own thread) for their partial decryptions (each party checks the round
itself, :class:`~.keyholder_party.KeyHolderParty`), and returns ``c0 + sum d_j``: the
plaintexts plus the parties' flooding, nothing else. A party that does not answer is named and
left out; the decryption is asked again of another set of ``T`` (each party's ledger allows
it, for the same aggregate), and fails with a line naming the parties that are down once fewer
than ``T`` answer.

Before it checks a round, the combiner has the ``T`` parties it expects to ask prepare it
(:meth:`JointDecryptor.prepare`, signed, answered at once): each fetches the aggregate and
computes its products while the combiner verifies, and releases nothing of them before a
request that passes its checks (:mod:`.party_prefetch`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from crypto.signing import BlockSigner
from crypto.threshold import aggregate_digest, combine, prepare_digest, request_digest
from fedps.errors import FedPSError, InvalidArgumentError, PeerUnavailableError
from fedps.rpc.fan_out import fan_out
from fedps.rpc.keyholder_party_messages import DecryptionRequest, PartyCanaries

__all__ = ["JointDecryptor", "PartyPeer"]

_log = logging.getLogger("fedps")

_T = TypeVar("_T")


class PartyPeer(Protocol):
    """A key-holder party as the combiner calls it (in process, or its gRPC client)."""

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """The party's signed canary partials; :class:`PeerUnavailableError` when it is down."""
        ...

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """The party's partial decryption; :class:`PeerUnavailableError` when it is down."""
        ...

    def prepare(self, request: DecryptionRequest) -> bool:
        """Have the party prepare the round ahead (it releases nothing); whether it started."""
        ...


class JointDecryptor:
    """Decrypts verified aggregates with ``T`` of the ``P`` key-holder parties.

    Parameters
    ----------
    parties
        Every party, by index ``1..P``.
    threshold
        T: how many decrypt together.
    modulus
        The prime q of the joint key.
    signer
        The combiner's signing key (the parties hold its public key).
    probe
        Whether party ``j`` answers at all (a hello); those that do not are left out before
        any is asked for the round, so that a round fewer than ``T`` parties can decrypt
        spends none of the answers each party's ledger allows it (the coordinator asks
        again until parties return). None: every party is asked.
    """

    def __init__(
        self,
        parties: Mapping[int, PartyPeer],
        *,
        threshold: int,
        modulus: int,
        signer: BlockSigner,
        probe: Callable[[int], bool] | None = None,
    ) -> None:
        if sorted(parties) != list(range(1, len(parties) + 1)) or not 1 <= threshold <= len(
            parties
        ):
            raise InvalidArgumentError("parties are indexed 1..P, and 1 <= T <= P")
        self._parties = dict(parties)
        self._threshold = threshold
        self._modulus = modulus
        self._signer = signer
        self._probe = probe
        #: the parties that did not answer the last request they were asked (status names them)
        self.down: set[int] = set()
        self._prepared: tuple[int, tuple[int, ...]] = (-1, ())  # a round, who prepared it

    def prepare(self, round_: int, contributors: Sequence[str]) -> tuple[int, ...]:
        """Have the ``T`` parties expected to decrypt ``round_`` prepare it; the parties asked.

        Those that did not answer the last request are not expected. Returns at once: each is
        asked from a thread of its own, and one that does not answer is only logged (the
        decryption that follows finds out which parties are down).
        """
        up = [j for j in sorted(self._parties) if j not in self.down]
        if len(up) < self._threshold:
            return ()
        participants = tuple(up[: self._threshold])
        names = tuple(sorted(contributors))
        request = DecryptionRequest(
            round=round_,
            contributors=names,
            participants=participants,
            aggregate=b"",
            signature=self._signer.sign(prepare_digest(round_, names, participants)),
        )
        self._prepared = (round_, participants)
        for j in participants:
            threading.Thread(
                target=self._prepare_one, args=(j, request), name=f"prepare-{j}", daemon=True
            ).start()
        return participants

    def _prepare_one(self, index: int, request: DecryptionRequest) -> None:
        try:
            self._parties[index].prepare(request)
        except FedPSError as exc:  # the decryption asks again, and names it if it is down
            _log.info("round %d: party %d did not prepare (%s)", request.round, index, exc)

    def decrypt(
        self,
        round_: int,
        contributors: Sequence[str],
        blocks: Sequence[int],
        rows: np.ndarray,
        *,
        c0: np.ndarray | None = None,
    ) -> np.ndarray:
        """``c0 + sum d_j`` of the verified aggregate ``rows`` (centred, ``(B, N)`` int64).

        ``rows`` are ``(B, 2N)`` uint64, one per block of ``blocks`` (in any order: the parties
        are asked about them in block order), summed over exactly ``contributors``; call only
        once the aggregate passed every check of the combiner. ``c0``: the first polynomials
        to add the partial decryptions to, ``(B, N)`` in the order of ``blocks`` (the rows'
        with the contributors' pads removed, :mod:`crypto.blinding`); None: the rows' own.

        Raises
        ------
        PeerUnavailableError
            Fewer than ``T`` parties answer (the message names those that are down).
        PolicyError
            A party refused the round (its check failed): nothing of it is decrypted.
        """
        order = np.argsort(np.asarray(blocks, dtype=np.int64), kind="stable")
        blocks, rows = [int(blocks[i]) for i in order], rows[order]  # as the parties fetch them
        digest = aggregate_digest(blocks, rows)
        n = rows.shape[1] // 2
        first = rows[:, :n] if c0 is None else c0[order]
        down: set[int] = set()
        if self._probe is not None:  # a set that cannot finish spends no party's answers
            down = {j for j in self._parties if not self._probe(j)}
        while True:
            up = [j for j in sorted(self._parties) if j not in down]
            if len(up) < self._threshold:
                self.down = down
                raise PeerUnavailableError(
                    f"round {round_}: {len(up)} of {len(self._parties)} key-holder parties "
                    f"answer, {self._threshold} must; down: "
                    + ", ".join(f"party {j}" for j in sorted(down))
                )
            participants = self._participants(round_, up)
            request = DecryptionRequest(
                round=round_,
                contributors=tuple(sorted(contributors)),
                participants=participants,
                aggregate=digest,
                signature=self._signer.sign(
                    request_digest(round_, contributors, participants, digest)
                ),
            )
            try:  # every participant at once: each waits for none of the others
                given = self._ask_all(round_, participants, _canaries_of(request))
                checked = replace(request, canaries=tuple(given[j] for j in participants))
                partials = self._ask_all(round_, participants, _partial_of(checked))
            except _PartiesDownError as exc:
                down |= exc.parties
                continue
            self.down = down
            plain = combine(first, [partials[j] for j in participants], self._modulus)
            out = np.empty_like(plain)
            out[order] = plain  # back in the caller's order of blocks
            return out

    def _participants(self, round_: int, up: Sequence[int]) -> tuple[int, ...]:
        """Those that prepared ``round_`` when all of them are ``up``; else the first ``T`` up."""
        prepared_round, prepared = self._prepared
        if prepared_round == round_ and set(prepared) <= set(up):
            return prepared
        return tuple(up[: self._threshold])

    def _ask_all(
        self, round_: int, participants: Sequence[int], call: Callable[[PartyPeer], _T]
    ) -> dict[int, _T]:
        """``call`` on every participant at once (:func:`fedps.rpc.fan_out.fan_out`), by index.

        Raises
        ------
        _PartiesDownError
            Naming every participant that did not answer (the others' answers are dropped).
        """

        def ask(index: int) -> _T | _PartyDownError:
            try:
                return call(_Answering(self._parties[index], index, round_))
            except _PartyDownError as exc:
                return exc

        outcomes = fan_out({j: partial(ask, j) for j in participants})
        answers = {j: o for j, o in outcomes.items() if not isinstance(o, _PartyDownError)}
        if len(answers) < len(outcomes):
            raise _PartiesDownError(set(outcomes) - set(answers))
        return answers


class _PartyDownError(Exception):
    """A party did not answer (internal: the combiner asks another set)."""

    def __init__(self, party: int) -> None:
        super().__init__(f"party {party} is down")
        self.party = party


def _canaries_of(request: DecryptionRequest) -> Callable[[PartyPeer], PartyCanaries]:
    """What asks a party for its canaries of ``request``."""
    return lambda peer: peer.canary_partial(request)


def _partial_of(request: DecryptionRequest) -> Callable[[PartyPeer], np.ndarray]:
    """What asks a party for its partial decryption of ``request``."""
    return lambda peer: peer.partial_decrypt(request)


class _PartiesDownError(Exception):
    """Participants that did not answer (internal: the combiner asks another set)."""

    def __init__(self, parties: set[int]) -> None:
        super().__init__(f"parties {sorted(parties)} are down")
        self.parties = parties


class _Answering:
    """A party's calls, with :class:`PeerUnavailableError` turned into :class:`_PartyDownError`."""

    def __init__(self, peer: PartyPeer, index: int, round_: int) -> None:
        self._peer, self._index, self._round = peer, index, round_

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """As :meth:`PartyPeer.canary_partial`."""
        try:
            return self._peer.canary_partial(request)
        except PeerUnavailableError as exc:
            raise self._down(exc) from exc

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """As :meth:`PartyPeer.partial_decrypt`."""
        try:
            return self._peer.partial_decrypt(request)
        except PeerUnavailableError as exc:
            raise self._down(exc) from exc

    def prepare(self, request: DecryptionRequest) -> bool:
        """As :meth:`PartyPeer.prepare`."""
        return self._peer.prepare(request)

    def _down(self, exc: PeerUnavailableError) -> _PartyDownError:
        _log.warning("round %d: key-holder party %d is down (%s)", self._round, self._index, exc)
        return _PartyDownError(self._index)
