"""Tests for the Flower strategy's settings: client-level DP through Flower takes every node
in every round, since its accounting assumes Poisson cohorts that Flower's sampling does not
draw."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedps.config import load_config
from fedps.errors import ConfigError
from server.flower.flower_strategy import FlowerStrategy


@pytest.mark.parametrize(
    ("fraction_train", "cohort_size"),
    [(0.5, 0), (1.0, 2)],
)
def test_client_level_dp_refuses_a_sampled_cohort(
    tmp_path: Path, fraction_train: float, cohort_size: int
) -> None:
    # Prepare
    config = load_config(
        None,
        cluster={"state_dir": str(tmp_path)},
        training={"clients": 4, "min_quorum": 2, "cohort_size": cohort_size},
        privacy={"level": "client", "noise_multiplier": 1.0},
    )

    # Execute / Assert
    with pytest.raises(ConfigError, match="every node in every round"):
        FlowerStrategy(config, fraction_train=fraction_train)
