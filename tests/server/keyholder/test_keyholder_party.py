"""Tests for a key-holder party: it decrypts only a round it checked itself, once."""

from __future__ import annotations

import math
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto import threshold as th
from crypto.canary import CanaryError
from crypto.signing import BlockSigner
from fedps.errors import InvalidArgumentError, PolicyError
from fedps.rpc.keyholder_party_messages import DecryptionRequest, PartyCanaries
from server.keyholder.keyholder_party import LEDGER_FILE, KeyHolderParty
from tests.crypto.threshold_keys import PARAMS, Joint, N, aggregate
from tests.server.keyholder.party_cluster import (
    COHORT,
    LAMBDA,
    MIN_QUORUM,
    Rounds,
    Switchable,
    start_parties,
)


@pytest.fixture
def combiner() -> BlockSigner:
    return BlockSigner()


def _request(
    signer: BlockSigner,
    round_: int,
    rows: np.ndarray,
    *,
    contributors: tuple[str, ...] = COHORT,
    participants: tuple[int, ...] = (1, 2),
) -> DecryptionRequest:
    digest = th.aggregate_digest(list(range(len(rows))), rows)
    return DecryptionRequest(
        round=round_,
        contributors=contributors,
        participants=participants,
        aggregate=digest,
        signature=signer.sign(th.request_digest(round_, contributors, participants, digest)),
    )


def _with_canaries(parties: dict[int, Switchable], request: DecryptionRequest) -> DecryptionRequest:
    """The request with every participant's signed canaries, as the combiner sends it."""
    canaries = tuple(parties[j].party.canary_partial(request) for j in request.participants)
    return replace(request, canaries=canaries)


def _cohort_rounds(rows: np.ndarray, *rounds_: int) -> Rounds:
    rounds = Rounds()
    for round_ in rounds_ or (1,):
        rounds.add(round_, COHORT, rows)
    return rounds


def test_a_checked_round_is_decrypted_by_any_two_parties(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    parties = start_parties(joint, 2, _cohort_rounds(rows), combiner, tmp_path)
    request = _with_canaries(parties, _request(combiner, 1, rows, participants=(2, 3)))
    # Execute
    partials = [parties[j].party.partial_decrypt(request) for j in request.participants]
    # Assert: c0 plus the partials is the single-key decryption plus two parties' flooding
    sigma = th.flooding_std(PARAMS, len(COHORT), parties=3, lambda_bits=LAMBDA)
    plain = th.combine(rows[:, :N], partials, joint.modulus)
    assert np.abs(plain - joint.exact(rows)).max() <= 13 * math.sqrt(2) * sigma + 2
    ledger = tmp_path / "party-2" / LEDGER_FILE
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600


def test_a_party_answers_only_for_a_set_of_t_parties_with_itself(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    party = start_parties(joint, 2, _cohort_rounds(rows), combiner, tmp_path)[1].party
    # Execute / Assert
    for participants in ((2, 3), (1,), (1, 2, 3)):
        with pytest.raises(InvalidArgumentError, match="party 1 among them"):
            party.canary_partial(_request(combiner, 1, rows, participants=participants))


def test_a_party_refuses_a_request_the_combiner_did_not_sign(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    rounds = _cohort_rounds(rows)
    party = start_parties(joint, 2, rounds, combiner, tmp_path)[1].party
    forged = _request(BlockSigner(), 1, rows)
    # Execute / Assert: nothing is even fetched from the shards
    for ask in (party.canary_partial, party.partial_decrypt):
        with pytest.raises(PolicyError, match="not signed by the combiner"):
            ask(forged)
    assert rounds.asked == 0


def test_a_party_refuses_one_client_and_sub_cohorts(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: round 1 closed with one client (below the quorum), round 2 with the cohort
    rounds = _cohort_rounds(rows, 2)
    rounds.add(1, ("a",), rows)
    rounds.add(3, COHORT[:MIN_QUORUM], rows)  # shards would sum a sub-cohort if asked
    party = start_parties(joint, 2, rounds, combiner, tmp_path)[1].party
    # Execute / Assert
    with pytest.raises(PolicyError, match="fewer than the minimum"):
        party.canary_partial(_request(combiner, 1, rows, contributors=("a",)))
    with pytest.raises(PolicyError, match="not the 4 the coordinator closed"):
        party.canary_partial(_request(combiner, 2, rows, contributors=COHORT[:MIN_QUORUM]))
    with pytest.raises(PolicyError, match="a contributor twice"):
        party.canary_partial(_request(combiner, 2, rows, contributors=("a", "a", "b", "c")))


def test_a_party_refuses_an_aggregate_the_shards_do_not_hold(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: the combiner verified (and signs) one aggregate, the shards hold another
    held = rows.copy()
    held[0, N + 5] = (held[0, N + 5] + np.uint64(1)) % np.uint64(joint.modulus)
    party = start_parties(joint, 2, _cohort_rounds(held), combiner, tmp_path)[1].party
    # Execute / Assert
    with pytest.raises(PolicyError, match="not the one the combiner verified"):
        party.canary_partial(_request(combiner, 1, rows))
    assert not (tmp_path / "party-1" / LEDGER_FILE).exists()  # nothing recorded, nothing sent


def test_a_party_decrypts_nothing_whose_canaries_it_did_not_check(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    parties = start_parties(joint, 2, _cohort_rounds(rows), combiner, tmp_path)
    request = _request(combiner, 1, rows)
    honest = _with_canaries(parties, request)
    mine, theirs = honest.canaries
    forged = PartyCanaries(theirs.party, bytes(len(theirs.canaries)), theirs.signature)
    resigned = PartyCanaries(mine.party, theirs.canaries, BlockSigner().sign(b"x" * 32))
    # Execute / Assert: none, one missing, another party's forged, its own not its own
    party = parties[1].party
    for canaries, match in [
        ((), "lacks a participant's canaries"),
        ((mine,), "lacks a participant's canaries"),
        ((mine, forged), "party 2's canaries are not signed by it"),
        ((resigned, theirs), "party 1's canaries are not signed by it"),
    ]:
        with pytest.raises(PolicyError, match=match):
            party.partial_decrypt(replace(request, canaries=canaries))
    party.partial_decrypt(honest)  # the control


def test_a_changed_c1_is_refused_by_every_party_before_any_partial(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: a client committed to (c0, c1 + t) itself: shards and combiner agree on it
    changed = rows.copy()
    changed[1, N + 9] = np.uint64((int(changed[1, N + 9]) + 2**30) % joint.modulus)
    parties = start_parties(joint, 2, _cohort_rounds(changed), combiner, tmp_path)
    request = _with_canaries(parties, _request(combiner, 1, changed))
    # Execute / Assert
    for j in request.participants:
        with pytest.raises(CanaryError, match="carries a change in c1"):
            parties[j].party.partial_decrypt(request)


def test_a_round_is_decrypted_for_one_aggregate_only_across_restarts(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    rounds = _cohort_rounds(rows)
    parties = start_parties(joint, 2, rounds, combiner, tmp_path)
    parties[1].party.partial_decrypt(_with_canaries(parties, _request(combiner, 1, rows)))
    other = aggregate(joint.public, 5, 2)[0]
    rounds.add(1, COHORT, other)  # the shards now hold another sum for the same round
    # Execute / Assert: a replay of round 1 with the other aggregate, before and after restart
    for restart in (False, True):
        if restart:
            parties[1].restart()
        with pytest.raises(PolicyError, match="answered for another aggregate"):
            parties[1].party.canary_partial(_request(combiner, 1, other))


def test_a_round_is_answered_at_most_twice_per_party(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: 2 P = 6 answers about one aggregate (canaries and partials of three attempts)
    parties = start_parties(joint, 2, _cohort_rounds(rows), combiner, tmp_path)
    for participants in ((1, 2), (1, 3), (1, 2)):
        request = _with_canaries(parties, _request(combiner, 1, rows, participants=participants))
        parties[1].party.partial_decrypt(request)
    # Execute / Assert
    with pytest.raises(PolicyError, match="6 times already"):
        parties[1].party.canary_partial(_request(combiner, 1, rows, participants=(1, 3)))


def test_a_party_is_listed_with_its_own_signing_key(joint: Joint, tmp_path: Path) -> None:
    # Prepare
    share = joint.shares(2)[0]
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="not its signing key"):
        KeyHolderParty(
            share,
            joint.public,
            combiner_key=BlockSigner().public_key,
            signer=BlockSigner(),
            party_keys={1: BlockSigner().public_key},
            source=Rounds(),
            state_dir=tmp_path,
            min_quorum=MIN_QUORUM,
            lambda_bits=LAMBDA,
        )
