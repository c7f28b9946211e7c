"""Tests for a key-holder party: it decrypts only a round it checked itself, once."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import numpy as np
import pytest

from crypto import threshold as th
from crypto.signing import BlockSigner
from fedps.errors import PolicyError
from fedps.rpc.keyholder_party_messages import DecryptionRequest
from server.keyholder.keyholder_party import LEDGER_FILE, KeyHolderParty
from tests.crypto.threshold_keys import PARAMS, Joint, N, aggregate, generate
from tests.server.keyholder.party_cluster import LAMBDA, MIN_QUORUM, Rounds, start_parties

COHORT = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(3)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    return aggregate(joint.public, len(COHORT), 2)[0]


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


def _party(
    joint: Joint, rounds: Rounds, combiner: BlockSigner, tmp_path: Path, index: int = 1
) -> KeyHolderParty:
    return start_parties(joint, 2, rounds, combiner, tmp_path)[index].party


def test_a_checked_round_is_decrypted_by_any_two_parties(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    rounds = Rounds()
    rounds.add(1, COHORT, rows)
    parties = start_parties(joint, 2, rounds, combiner, tmp_path)
    request = _request(combiner, 1, rows)
    # Execute
    partials = [parties[j].party.partial_decrypt(request) for j in request.participants]
    # Assert: c0 plus the partials is the single-key decryption plus two parties' flooding
    sigma = th.flooding_std(PARAMS, len(COHORT), parties=3, lambda_bits=LAMBDA)
    plain = th.combine(rows[:, :N], partials, joint.modulus)
    assert np.abs(plain - joint.exact(rows)).max() <= 13 * math.sqrt(2) * sigma + 2
    ledger = tmp_path / "party-1" / LEDGER_FILE
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600


def test_a_party_refuses_a_request_the_combiner_did_not_sign(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    rounds = Rounds()
    rounds.add(1, COHORT, rows)
    party = _party(joint, rounds, combiner, tmp_path)
    forged = _request(BlockSigner(), 1, rows)
    # Execute / Assert: nothing is even fetched from the shards
    with pytest.raises(PolicyError, match="not signed by the combiner"):
        party.partial_decrypt(forged)
    assert rounds.asked == 0


def test_a_party_refuses_one_client_and_sub_cohorts(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: round 1 closed with one client (below the quorum), round 2 with the cohort
    rounds = Rounds()
    rounds.add(1, ("a",), rows)
    rounds.add(2, COHORT, rows)
    rounds.add(3, COHORT[:MIN_QUORUM], rows)  # shards would sum a sub-cohort if asked
    party = _party(joint, rounds, combiner, tmp_path)
    # Execute / Assert
    with pytest.raises(PolicyError, match="fewer than the minimum"):
        party.partial_decrypt(_request(combiner, 1, rows, contributors=("a",)))
    with pytest.raises(PolicyError, match="not the 4 the coordinator closed"):
        party.partial_decrypt(_request(combiner, 2, rows, contributors=COHORT[:MIN_QUORUM]))
    with pytest.raises(PolicyError, match="a contributor twice"):
        party.partial_decrypt(_request(combiner, 2, rows, contributors=("a", "a", "b", "c")))


def test_a_party_refuses_an_aggregate_the_shards_do_not_hold(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: the combiner verified (and signs) one aggregate, the shards hold another
    held = rows.copy()
    held[0, N + 5] = (held[0, N + 5] + np.uint64(1)) % np.uint64(joint.modulus)
    rounds = Rounds()
    rounds.add(1, COHORT, held)
    party = _party(joint, rounds, combiner, tmp_path)
    # Execute / Assert
    with pytest.raises(PolicyError, match="not the one the combiner verified"):
        party.partial_decrypt(_request(combiner, 1, rows))
    assert not (tmp_path / "party-1" / LEDGER_FILE).exists()  # nothing recorded, nothing sent


def test_a_round_is_decrypted_for_one_aggregate_only_across_restarts(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare
    rounds = Rounds()
    rounds.add(1, COHORT, rows)
    party = _party(joint, rounds, combiner, tmp_path)
    party.partial_decrypt(_request(combiner, 1, rows))
    other = aggregate(joint.public, 5, 2)[0]
    rounds.add(1, COHORT, other)  # the shards now hold another sum for the same round
    restarted = KeyHolderParty(
        party.share,
        joint.public,
        combiner_key=combiner.public_key,
        source=rounds,
        state_dir=tmp_path / "party-1",
        min_quorum=MIN_QUORUM,
        lambda_bits=LAMBDA,
    )
    # Execute / Assert: a replay of round 1 with the other aggregate, before and after restart
    for instance in (party, restarted):
        with pytest.raises(PolicyError, match="decrypted with another aggregate"):
            instance.partial_decrypt(_request(combiner, 1, other))


def test_a_round_is_decrypted_at_most_once_per_party_set(
    joint: Joint, rows: np.ndarray, combiner: BlockSigner, tmp_path: Path
) -> None:
    # Prepare: P = 3 retries of one aggregate are allowed (a party went down), not more
    rounds = Rounds()
    rounds.add(1, COHORT, rows)
    party = _party(joint, rounds, combiner, tmp_path)
    for participants in ((1, 2), (1, 3), (1, 2)):
        party.partial_decrypt(_request(combiner, 1, rows, participants=participants))
    # Execute / Assert
    with pytest.raises(PolicyError, match="3 times already"):
        party.partial_decrypt(_request(combiner, 1, rows, participants=(1, 3)))
