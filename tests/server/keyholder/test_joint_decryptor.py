"""Tests for the combiner: T parties decrypt, a party down is left out, fewer than T stop."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from crypto import threshold as th
from crypto.canary import CanaryError
from crypto.signing import BlockSigner
from fedps.errors import PeerUnavailableError, PolicyError
from server.keyholder.joint_decryptor import JointDecryptor
from server.keyholder.keyholder_party import LEDGER_FILE
from tests.crypto.threshold_keys import PARAMS, Joint, N
from tests.server.keyholder.party_cluster import COHORT, LAMBDA, Rounds, Switchable, start_parties


def _cluster(
    joint: Joint, rows: np.ndarray, threshold: int, tmp_path: Path
) -> tuple[JointDecryptor, dict[int, Switchable]]:
    rounds = Rounds()
    for round_ in (1, 2, 3):
        rounds.add(round_, COHORT, rows)
    signer = BlockSigner()
    parties = start_parties(joint, threshold, rounds, signer, tmp_path)
    combiner = JointDecryptor(parties, threshold=threshold, modulus=joint.modulus, signer=signer)
    return combiner, parties


def _within_flooding(joint: Joint, rows: np.ndarray, plain: np.ndarray, threshold: int) -> bool:
    sigma = th.flooding_std(PARAMS, len(COHORT), parties=3, lambda_bits=LAMBDA)
    return bool(np.abs(plain - joint.exact(rows)).max() <= 13 * math.sqrt(threshold) * sigma + 3)


def test_two_of_three_carry_on_with_one_party_down_and_stop_with_two(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare
    combiner, parties = _cluster(joint, rows, 2, tmp_path)
    blocks = list(range(len(rows)))
    # Execute / Assert: all up
    assert _within_flooding(joint, rows, combiner.decrypt(1, COHORT, blocks, rows), 2)
    assert combiner.down == set()
    # one down: the round is decrypted by the other two, and the combiner names it
    parties[1].up = False
    assert _within_flooding(joint, rows, combiner.decrypt(2, COHORT, blocks, rows), 2)
    assert combiner.down == {1}
    # two down: a clear line naming both, nothing decrypted
    parties[3].up = False
    with pytest.raises(PeerUnavailableError, match="1 of 3 key-holder parties answer, 2 must"):
        combiner.decrypt(3, COHORT, blocks, rows)
    assert combiner.down == {1, 3}
    # one returns: the same round goes through
    parties[1].up = True
    assert _within_flooding(joint, rows, combiner.decrypt(3, COHORT, blocks, rows), 2)


def test_three_of_three_needs_every_party(joint: Joint, rows: np.ndarray, tmp_path: Path) -> None:
    # Prepare
    combiner, parties = _cluster(joint, rows, 3, tmp_path)
    blocks = list(range(len(rows)))
    assert _within_flooding(joint, rows, combiner.decrypt(1, COHORT, blocks, rows), 3)
    parties[2].up = False
    # Execute / Assert
    with pytest.raises(PeerUnavailableError, match="down: party 2"):
        combiner.decrypt(2, COHORT, blocks, rows)


def test_a_party_refusal_stops_the_round(joint: Joint, rows: np.ndarray, tmp_path: Path) -> None:
    # Prepare: the combiner asks for a sub-cohort of the closed round
    combiner, _ = _cluster(joint, rows, 2, tmp_path)
    # Execute / Assert
    with pytest.raises(PolicyError, match="coordinator closed"):
        combiner.decrypt(1, COHORT[:3], list(range(len(rows))), rows)


def test_a_changed_c1_is_refused_and_nothing_is_decrypted(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare: the aggregate the shards hold and the combiner verified carries t in c1
    changed = rows.copy()
    changed[0, N + 3] = np.uint64((int(changed[0, N + 3]) + 2**29) % joint.modulus)
    combiner, _ = _cluster(joint, changed, 2, tmp_path)
    # Execute / Assert
    with pytest.raises(CanaryError):
        combiner.decrypt(1, COHORT, list(range(len(changed))), changed)


def test_the_parties_expected_to_decrypt_prepare_the_round(
    joint: Joint, rows: np.ndarray, tmp_path: Path
) -> None:
    # Prepare: party 1 was down at the last round
    combiner, parties = _cluster(joint, rows, 2, tmp_path)
    blocks = list(range(len(rows)))
    parties[1].up = False
    combiner.decrypt(1, COHORT, blocks, rows)
    parties[1].up = True
    # Execute: round 2 prepared (by the two that answered last), then decrypted
    asked = combiner.prepare(2, COHORT)
    plain = combiner.decrypt(2, COHORT, blocks, rows)
    # Assert: those that prepared it decrypted it (party 1, up again, was not asked)
    assert asked == (2, 3)
    assert _within_flooding(joint, rows, plain, 2)
    assert not (tmp_path / "party-1" / LEDGER_FILE).exists()
