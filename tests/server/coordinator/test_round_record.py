"""A round's records (server/coordinator/round_record.py): the phases a client reports are
checked like its metrics, and a round's critical path is put together from them."""

from __future__ import annotations

import math

import pytest

from fedps.errors import InvalidArgumentError
from server.coordinator.round_record import (
    check_phase_seconds,
    critical_path,
    known_phases,
    slowest_clients,
)


@pytest.mark.parametrize(
    ("phases", "match"),
    [
        ({"train": math.nan}, "not finite"),
        ({"train": math.inf}, "not finite"),
        ({"train": -0.5}, "not within"),
        ({"train": 8 * 86400.0}, "not within"),
        ({"": 1.0}, "name"),
        ({"x" * 33: 1.0}, "name"),
        ({f"phase{i}": 1.0 for i in range(33)}, "at most 32"),
    ],
)
def test_reported_phases_that_are_not_a_few_finite_non_negative_numbers_are_refused(
    phases: dict[str, float], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        check_phase_seconds(phases)


def test_known_phases_keep_their_order_and_leave_other_names_out() -> None:
    # Execute
    kept = known_phases({"push": 1.0, "warp_drive": 2.0, "pull": 0.5}, ("pull", "push"))
    # Assert
    assert list(kept.items()) == [("pull", 0.5), ("push", 1.0)]


def test_the_critical_path_follows_the_client_that_committed_last() -> None:
    # Prepare: client-1 took longest up to the barrier (and waited least at it)
    clients = {
        "client-0": {"pull": 0.1, "train": 1.0, "commit": 0.1, "barrier": 0.8, "push": 0.2},
        "client-1": {"pull": 0.1, "train": 1.7, "commit": 0.1, "barrier": 0.1, "push": 0.3},
    }
    server = {"open": 0.05, "commit_wait": 1.9, "push_wait": 0.5, "close": 0.05, "verify": 0.1}
    # Execute
    path = critical_path(3.0, server, clients)
    # Assert
    assert path["train"] == 1.7 and path["barrier"] == 0.1 and path["push"] == 0.3
    assert "commit_wait" not in path and "push_wait" not in path  # the clients' time instead
    assert list(path) == [
        "open",
        "pull",
        "train",
        "commit",
        "barrier",
        "push",
        "close",
        "verify",
        "other",
    ]
    assert math.isclose(sum(path.values()), 3.0)
    assert math.isclose(path["other"], 3.0 - 0.05 - 0.1 - 1.7 - 0.1 - 0.1 - 0.3 - 0.05 - 0.1)


def test_a_round_without_clients_has_the_servers_phases_and_other() -> None:
    path = critical_path(1.0, {"open": 0.25, "close": 0.5}, {})

    assert path == {"open": 0.25, "close": 0.5, "other": 0.25}


def test_a_record_keeps_the_phases_of_the_slowest_clients_to_commit() -> None:
    # Prepare
    reported = {f"client-{i}": {"train": float(i), "barrier": 10.0 - i} for i in range(20)}
    # Execute
    kept = slowest_clients(reported, most=3)
    # Assert
    assert sorted(kept) == ["client-17", "client-18", "client-19"]
