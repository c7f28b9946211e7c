"""Tests for the closed sets key-holder parties ask the coordinator for."""

from __future__ import annotations

import pytest

from fedps.errors import InvalidArgumentError
from server.coordinator.closed_rounds import ClosedRounds

KEPT = 8


def test_the_last_rounds_sent_are_kept_and_no_other() -> None:
    # Prepare
    closed = ClosedRounds(kept=KEPT)
    # Execute
    for round_ in range(1, KEPT + 3):
        closed.add(round_, frozenset({f"client-{round_}", "client-0"}))
    closed.add(KEPT + 2, frozenset({"client-0"}))  # sent again, without one client
    # Assert
    assert closed.get(KEPT + 2) == frozenset({"client-0"})
    assert closed.get(3) == frozenset({"client-3", "client-0"})
    for gone in (1, 2, KEPT + 3):
        with pytest.raises(InvalidArgumentError, match=f"round {gone} is not a round"):
            closed.get(gone)
