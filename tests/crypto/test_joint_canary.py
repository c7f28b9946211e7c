"""Tests for the joint canary check: honest aggregates pass, any change to ``c1`` is refused.

The honest bound is a proven tail (2^-120 per value); a change is refused when one of the
6 x 32 combined canaries is beyond it (2^29.4 here). The changes are large enough (2^27 per
term and more) that one passes only if all six weights of its block are below 6 (2^-33) or
every coefficient of ``s`` it meets at the canaries is 0 (3^-32), or, for changes in two
blocks, if the weights cancel them in all six combinations (2^-48).
"""

from __future__ import annotations

import numpy as np
import pytest

from crypto import threshold as th
from crypto.canary import CanaryError
from crypto.joint_canary import COMBINATIONS, WEIGHT_BITS, CanaryCheck, canary_weights
from tests.crypto.threshold_keys import PARAMS, Joint, N, aggregate, generate

PARTIES = 3
CLIENTS = 4
BLOCKS = 3


@pytest.fixture(scope="module")
def joint() -> Joint:
    return generate(PARTIES)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    return aggregate(joint.public, CLIENTS, BLOCKS)[0]


def _check(joint: Joint, rows: np.ndarray, threshold: int, participants: list[int]) -> None:
    """Every participant's canary partial, then the check (raises CanaryError on a change)."""
    shares = joint.shares(threshold)
    digest = th.aggregate_digest(list(range(len(rows))), rows)
    check = CanaryCheck(PARAMS, PARTIES, threshold, CLIENTS, digest, len(rows))
    partials = [check.partial(shares[j - 1], rows[:, N:], participants) for j in participants]
    check.verify(rows[:, :N], partials, joint.modulus)


def _changed(joint: Joint, rows: np.ndarray, changes: dict[tuple[int, int], int]) -> np.ndarray:
    """``rows`` with ``c1`` of block ``b`` changed by ``d`` at coefficient ``k``."""
    out = rows.copy()
    for (block, k), d in changes.items():
        out[block, N + k] = np.uint64((int(out[block, N + k]) + d) % joint.modulus)
    return out


def test_weights_are_the_aggregates_alone() -> None:
    # Prepare / Execute
    first, again = canary_weights(b"d" * 32, 500), canary_weights(b"d" * 32, 500)
    other = canary_weights(b"e" * 32, 500)
    # Assert
    assert first.shape == (COMBINATIONS, 500)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert first.min() >= 1 and first.max() <= 2**WEIGHT_BITS


@pytest.mark.parametrize(("threshold", "participants"), [(3, [1, 2, 3]), (2, [1, 3]), (2, [2, 3])])
def test_an_honest_aggregate_passes(
    joint: Joint, rows: np.ndarray, threshold: int, participants: list[int]
) -> None:
    # Execute / Assert: no CanaryError
    _check(joint, rows, threshold, participants)


@pytest.mark.parametrize(
    "changes",
    [
        {(0, 5): 2**30},  # one big term
        {(2, 64): -(2**27)},  # one term in the last block, on a canary's position
        {(0, 7): 2**28, (1, 7): -(2**28)},  # two blocks that cancel with equal weights
        {(1, k): 2**26 for k in range(0, N, 97)},  # a dense change in one block
    ],
    ids=["big", "on-canary", "cancelling", "dense"],
)
def test_a_change_to_c1_is_refused(
    joint: Joint, rows: np.ndarray, changes: dict[tuple[int, int], int]
) -> None:
    # Prepare
    changed = _changed(joint, rows, changes)
    # Execute / Assert
    with pytest.raises(CanaryError, match="carries a change in c1"):
        _check(joint, changed, 2, [1, 2])


def test_the_bound_grows_with_the_weights_and_the_floods() -> None:
    # Prepare
    check = CanaryCheck(PARAMS, PARTIES, 2, 100, b"d" * 32, 534)
    # Execute / Assert: 2^27.7 honest, flooded 2^3 times by each of two parties, at 13 sigmas
    assert 2**27.5 < check.honest_bound < 2**27.9
    assert check.sigma == 8 * check.honest_bound
    assert 2**34.7 < check.bound < 2**35.1
    assert check.bound < joint_headroom()


def joint_headroom() -> float:
    """q / 4 at the defaults: a bound beyond it would pass values that wrapped."""
    return 2.0 ** (PARAMS.coeff_modulus_bits - 2)
