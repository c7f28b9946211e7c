"""Tests for clients.replay: the update a replaying client sends instead of training."""

from __future__ import annotations

import numpy as np

from clients.replay import ReplayedUpdate
from clients.train_step import TrainStep
from fedps.config import load_config

_STEP = TrainStep("client-0", "c0", round=1, version=0, deadline_unix=0.0, weight=1.0)


def _never(step: TrainStep, params: np.ndarray) -> np.ndarray:
    raise AssertionError("a replaying client never trains")


def test_the_update_has_the_model_size_and_the_dp_scale_and_never_trains() -> None:
    # Prepare
    config = load_config(None, privacy={"target_epsilon": None, "noise_multiplier": 2.0})
    replay = ReplayedUpdate.dp_scaled(config, seed=3)
    params = np.zeros(50_000, np.float32)

    # Execute
    first = replay(_STEP, params, _never)
    second = replay(_STEP, params, _never)

    # Assert
    t, p = config.training, config.privacy
    assert first.shape == params.shape and first.dtype == np.float32
    expected = t.lr * 2.0 * p.max_grad_norm / t.batch_size
    assert abs(float(np.std(first)) / expected - 1) < 0.02
    assert second is first  # drawn once, the same every round


def test_the_same_seed_gives_the_same_update() -> None:
    # Prepare
    params = np.zeros(1000, np.float32)

    # Execute
    a = ReplayedUpdate(std=0.1, seed=7)(_STEP, params, _never)
    b = ReplayedUpdate(std=0.1, seed=7)(_STEP, params, _never)

    # Assert
    np.testing.assert_array_equal(a, b)
