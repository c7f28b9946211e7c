"""Tests for a party's round prepared ahead: the same answers, and only after the same checks."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto import threshold as th
from crypto.signing import BlockSigner
from fedps.errors import PolicyError
from fedps.rpc.keyholder_party_messages import DecryptionRequest
from server.keyholder.keyholder_party import LEDGER_FILE
from server.keyholder.party_prefetch import PartyPrefetch, PreparedRound
from tests.crypto.threshold_keys import PARAMS, Joint, N
from tests.server.keyholder.party_cluster import COHORT, LAMBDA, Rounds, Switchable, start_parties


def _prepare(
    signer: BlockSigner,
    round_: int,
    *,
    contributors: tuple[str, ...] = COHORT,
    participants: tuple[int, ...] = (1, 2),
) -> DecryptionRequest:
    """The combiner's signed prepare of ``round_``."""
    return DecryptionRequest(
        round=round_,
        contributors=contributors,
        participants=participants,
        aggregate=b"",
        signature=signer.sign(th.prepare_digest(round_, contributors, participants)),
    )


def _request(
    signer: BlockSigner, round_: int, rows: np.ndarray, participants: tuple[int, ...] = (1, 2)
) -> DecryptionRequest:
    digest = th.aggregate_digest(list(range(len(rows))), rows)
    return DecryptionRequest(
        round=round_,
        contributors=COHORT,
        participants=participants,
        aggregate=digest,
        signature=signer.sign(th.request_digest(round_, COHORT, participants, digest)),
    )


def _decrypt(parties: dict[int, Switchable], request: DecryptionRequest) -> list[np.ndarray]:
    """Every participant's canaries, then every participant's partial, as the combiner asks."""
    canaries = tuple(parties[j].party.canary_partial(request) for j in request.participants)
    checked = replace(request, canaries=canaries)
    return [parties[j].party.partial_decrypt(checked) for j in request.participants]


def _within_flooding(joint: Joint, rows: np.ndarray, partials: list[np.ndarray]) -> bool:
    sigma = th.flooding_std(PARAMS, len(COHORT), parties=3, lambda_bits=LAMBDA)
    plain = th.combine(rows[:, :N], partials, joint.modulus)
    return bool(np.abs(plain - joint.exact(rows)).max() <= 13 * math.sqrt(2) * sigma + 2)


@pytest.mark.parametrize("asked", [(1, 2), (1, 3)])
def test_a_prepared_round_decrypts_as_one_fetched_when_asked(
    joint: Joint, rows: np.ndarray, tmp_path: Path, asked: tuple[int, int]
) -> None:
    # Prepare: parties 1 and 2 prepare round 1; the combiner then asks ``asked``
    combiner, rounds = BlockSigner(), Rounds()
    rounds.add(1, COHORT, rows)
    parties = start_parties(joint, 2, rounds, combiner, tmp_path)
    started = [parties[j].party.prepare(_prepare(combiner, 1)) for j in (1, 2)]
    # Execute
    partials = _decrypt(parties, _request(combiner, 1, rows, asked))
    # Assert: the same plaintexts within the flooding; a prepared party fetched once, and one
    # prepared for another set of participants still decrypts right (its products computed then)
    assert started == [True, True]
    assert _within_flooding(joint, rows, partials)
    assert rounds.asked == (2 if asked == (1, 2) else 3)


def test_a_prepare_not_signed_by_the_combiner_fetches_nothing(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare: a forged prepare, and the combiner's signature of a request used as a prepare
    combiner, rounds = BlockSigner(), Rounds()
    rounds.add(1, COHORT, rows)
    party = start_parties(joint, 2, rounds, combiner, tmp_path)[1].party
    request = _request(combiner, 1, rows)
    as_prepare = replace(request, aggregate=b"")
    # Execute / Assert: nothing is fetched, and a prepare's signature is no request's
    for forged in (_prepare(BlockSigner(), 1), as_prepare):
        with pytest.raises(PolicyError, match="prepare is not signed by the combiner"):
            party.prepare(forged)
    prepare = _prepare(combiner, 1)
    with pytest.raises(PolicyError, match="request is not signed by the combiner"):
        party.canary_partial(replace(prepare, aggregate=request.aggregate))
    assert rounds.asked == 0


def test_what_is_prepared_leaves_only_for_the_aggregate_the_combiner_verified(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare: the shards hold a changed aggregate; the combiner verified (and signs) another
    combiner, rounds = BlockSigner(), Rounds()
    held = rows.copy()
    held[0, N + 5] = (held[0, N + 5] + np.uint64(1)) % np.uint64(joint.modulus)
    rounds.add(1, COHORT, held)
    party = start_parties(joint, 2, rounds, combiner, tmp_path)[1].party
    assert party.prepare(_prepare(combiner, 1))
    # Execute / Assert: refused, nothing recorded (nothing sent)
    with pytest.raises(PolicyError, match="not the one the combiner verified"):
        party.canary_partial(_request(combiner, 1, rows))
    assert not (tmp_path / "party-1" / LEDGER_FILE).exists()


def test_a_prepare_for_a_set_the_coordinator_did_not_close_prepares_nothing(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare: round 1 closed with the cohort; a prepare names three of them
    combiner, rounds = BlockSigner(), Rounds()
    rounds.add(1, COHORT, rows)
    rounds.add(1, COHORT[:3], rows)  # the shards would sum a sub-cohort if asked
    rounds.closed[1] = frozenset(COHORT)
    parties = start_parties(joint, 2, rounds, combiner, tmp_path)
    for j in (1, 2):
        parties[j].party.prepare(_prepare(combiner, 1, contributors=COHORT[:3]))
    # Execute: the round over the cohort, asked as usual
    partials = _decrypt(parties, _request(combiner, 1, rows))
    # Assert: the sub-cohort's sum was never fetched; the round decrypts as usual
    assert rounds.asked == 2
    assert _within_flooding(joint, rows, partials)


def test_a_request_waits_for_the_round_being_prepared_and_takes_it() -> None:
    # Prepare: a preparation held until released
    release, entered = threading.Event(), threading.Event()
    rows = np.zeros((1, 2), dtype=np.uint64)

    def work(round_: int, contributors: frozenset[str], parties: tuple[int, ...]) -> PreparedRound:
        entered.set()
        release.wait()
        return PreparedRound((round_, contributors), [0], rows, b"d", parties, product=rows)

    prefetch = PartyPrefetch(work)
    cohort = frozenset(COHORT)
    assert prefetch.start(1, cohort, (2, 1))
    entered.wait()
    taken: list[PreparedRound | None] = []
    waiter = threading.Thread(target=lambda: taken.append(prefetch.take(1, cohort)))
    # Execute: another start while it runs, another round's take, then the release
    waiter.start()
    again = prefetch.start(2, cohort, (1, 2))
    other = prefetch.take(2, cohort)
    release.set()
    waiter.join()
    # Assert
    assert not again and other is None
    assert taken[0] is not None and taken[0].products_for((1, 2)) is taken[0]
    assert taken[0].products_for((1, 3)) is None
    assert not prefetch.start(1, cohort, (1, 2))  # prepared already
