"""A key-holder party's work on a round done ahead, while the combiner still checks it.

The combiner verifies a round's aggregate against the clients' commitments before it asks any
party for anything (:class:`~.joint_decryptor.JointDecryptor`); a party then fetches the same
aggregate from the shards, hashes it, computes its canaries and its product ``c1 (lambda_j
sh_j)``. None of that depends on the combiner's answer, so the combiner tells the round's
participants when it starts (a signed prepare, :meth:`.keyholder_party.KeyHolderParty.prepare`)
and each does it meanwhile, on its own host.

What is done ahead is never released as it is: a :class:`PreparedRound` holds the fetched
aggregate (read-only), its digest, and the **unflooded** products, kept in the party's memory.
The requests that follow make every check they make without it (the combiner's signature, the
coordinator's contributor set, the digest the combiner signed against the one the party
computed, the joint canaries, the ledger), and only then take the prepared products, flood
them, and answer. A prepare that names another set, a round the coordinator did not close or
an aggregate that turns out to be another than the request's is simply not used.

:class:`PartyPrefetch` runs one preparation at a time on a thread; a request for the round
being prepared waits for it rather than fetching the aggregate a second time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedps.errors import FedPSError

__all__ = ["PartyPrefetch", "PreparedRound", "RoundKey"]

_log = logging.getLogger("fedps")

#: A round and the contributor set its aggregate sums.
RoundKey = tuple[int, frozenset[str]]


@dataclass(frozen=True)
class PreparedRound:
    """A round's aggregate as the party fetched it, and what it computed of it ahead.

    Attributes
    ----------
    key
        The round and its contributor set.
    blocks
        The aggregate's block indices, ``0..B-1``.
    rows
        Its ``(B, 2N)`` uint64 coefficients, read-only: what was hashed is what is decrypted.
    digest
        :func:`crypto.threshold.aggregate_digest` of ``blocks`` and ``rows``.
    participants
        The set of parties the products are for (their Lagrange coefficients); empty: none.
    canaries
        The unflooded canaries of the block combinations (:meth:`crypto.joint_canary.
        CanaryCheck.product`), or None.
    product
        The unflooded ``c1 (lambda_j sh_j)``, ``(B, N)`` (:meth:`crypto.partial_decryptor.
        PartialDecryptor.product`), or None.
    """

    key: RoundKey
    blocks: list[int]
    rows: np.ndarray
    digest: bytes
    participants: tuple[int, ...] = ()
    canaries: np.ndarray | None = None
    product: np.ndarray | None = None

    def products_for(self, participants: tuple[int, ...]) -> PreparedRound | None:
        """The round with its products if they are for ``participants``; None otherwise."""
        if self.product is None or tuple(sorted(participants)) != self.participants:
            return None
        return self


class PartyPrefetch:
    """One round prepared at a time, on a thread of its own.

    Parameters
    ----------
    work
        Prepares ``(round, contributors, participants)``; its errors (a shard that does not
        answer, a set the coordinator did not close) only mean that nothing was prepared.
    """

    def __init__(
        self, work: Callable[[int, frozenset[str], tuple[int, ...]], PreparedRound]
    ) -> None:
        self._work = work
        self._changed = threading.Condition()
        self._key: RoundKey | None = None
        self._running = False
        self._done: PreparedRound | None = None

    def start(
        self, round_: int, contributors: frozenset[str], participants: tuple[int, ...]
    ) -> bool:
        """Prepare ``round_`` over ``contributors`` for ``participants``; whether it started.

        Not while another preparation runs, nor for the round prepared last.
        """
        key = (round_, contributors)
        with self._changed:
            if self._running or self._key == key:
                return False
            self._key, self._running, self._done = key, True, None
        threading.Thread(
            target=self._run, args=(key, tuple(sorted(participants))), daemon=True
        ).start()
        return True

    def take(self, round_: int, contributors: frozenset[str]) -> PreparedRound | None:
        """What was prepared of ``round_`` over ``contributors`` (waited for), or None."""
        key = (round_, contributors)
        with self._changed:
            while self._running and self._key == key:
                self._changed.wait()
            return self._done if self._key == key else None

    def _run(self, key: RoundKey, participants: tuple[int, ...]) -> None:
        done: PreparedRound | None = None
        try:
            done = self._work(key[0], key[1], participants)
        except FedPSError as exc:  # nothing prepared: the request does it all itself
            _log.info("round %d: not prepared ahead (%s)", key[0], exc)
        except Exception:  # a programming error: logged, and the request does it itself
            _log.exception("round %d: preparing it ahead failed", key[0])
        with self._changed:
            self._done, self._running = done, False
            self._changed.notify_all()
