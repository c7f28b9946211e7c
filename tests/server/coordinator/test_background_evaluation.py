"""Tests for server.coordinator.background_evaluation, as the coordinator's round loop uses it:
each round's published model is evaluated while the next round runs, its record enters the
history once, in round order, and a checkpoint written meanwhile keeps it for a restart to
evaluate."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedps.config import load_config
from fedps.errors import PeerUnavailableError
from server.coordinator.background_evaluation import BackgroundEvaluation
from server.coordinator.coordinator import Coordinator
from server.coordinator.round_record import OpenRound, RoundRecord
from server.serve import open_coordinator


def _coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, evaluated: list[int]
) -> tuple[Coordinator, threading.Event]:
    """A coordinator whose round loop evaluates in the background; version 1's evaluation waits
    for the event. Each evaluated version is added to ``evaluated``, its accuracy a tenth of it.
    """
    config = load_config(None, cluster={"state_dir": str(tmp_path)})
    coordinator = open_coordinator(config, tmp_path / "coordinator")
    release = threading.Event()

    def evaluate(version: int) -> tuple[np.ndarray, dict[str, float]]:
        if version == 1:
            release.wait(timeout=60)
        evaluated.append(version)
        return np.zeros(coordinator.layout.num_params), {"accuracy": version / 10, "loss": 1.0}

    monkeypatch.setattr(coordinator, "_evaluate", evaluate)
    coordinator._background = True
    return coordinator, release


def _finish(coordinator: Coordinator, round_: int) -> None:
    """Round ``round_`` ends, applied as version ``round_``."""
    coordinator.version = round_
    coordinator._finish_round(RoundRecord(round_, round_, 3), time.time(), 0)


def test_each_round_is_recorded_once_in_order_after_its_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: round 1 ends, its evaluation held
    evaluated: list[int] = []
    coordinator, release = _coordinator(tmp_path, monkeypatch, evaluated)
    _finish(coordinator, 1)
    # Execute: round 2 opens (its checkpoint does not wait), then round 1's evaluation ends
    # and round 2 ends
    seen = (coordinator.round, coordinator.recorded_round, len(coordinator.history))
    coordinator._checkpoint(OpenRound(2, 1, math.inf, frozenset({"client-0"})))
    release.set()
    _finish(coordinator, 2)
    coordinator._settle_evaluation()
    # Assert: round 1 was finished but not yet recorded; then each round once, in order
    assert seen == (1, 0, 0)
    assert [(r.round, r.accuracy) for r in coordinator.history] == [(1, 0.1), (2, 0.2)]
    assert evaluated == [1, 2] and coordinator.recorded_round == 2


def test_a_restart_evaluates_the_round_a_checkpoint_kept_while_it_was_evaluated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: round 2's commit-phase checkpoint is written while round 1 is evaluated
    evaluated: list[int] = []
    coordinator, release = _coordinator(tmp_path, monkeypatch, evaluated)
    _finish(coordinator, 1)
    coordinator._checkpoint(OpenRound(2, 1, math.inf, frozenset({"client-0"})))
    release.set()
    coordinator._settle_evaluation()
    # Execute: a coordinator restarted from that checkpoint evaluates round 1 again
    restarted, released = _coordinator(tmp_path, monkeypatch, evaluated)
    released.set()
    kept = [(r.round, r.accuracy) for r in restarted.history]
    restarted.version = 1  # the key holder's, as bootstrap reads it
    restarted._evaluate_restored()
    # Assert: the round was kept once, unevaluated, and is evaluated once
    assert kept == [(1, -1.0)]
    assert [(r.round, r.accuracy) for r in restarted.history] == [(1, 0.1)]


def test_a_failed_evaluation_records_nothing_and_raises_in_the_waiting_thread() -> None:
    # Prepare: an evaluation whose pull fails (a stop ended it)
    recorded: list[RoundRecord] = []

    def fail() -> tuple[np.ndarray, dict[str, float]]:
        raise PeerUnavailableError("stopping")

    evaluation = BackgroundEvaluation(RoundRecord(3, 3, 2), fail, recorded.append)
    # Execute
    evaluation.start()
    # Assert
    with pytest.raises(PeerUnavailableError, match="stopping"):
        evaluation.wait()
    assert recorded == []
