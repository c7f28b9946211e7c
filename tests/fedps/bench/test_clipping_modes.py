"""``fedps bench``'s DP-SGD round with ghost clipping against per-sample gradients, on the small
demo model: every figure is there and each mode ran its rounds (no figure is compared with
another: they are timings)."""

from __future__ import annotations

import math

from fedps.bench.clipping_modes import measure_clipping


def test_each_mode_runs_its_rounds_and_every_figure_is_there() -> None:
    # Execute
    result = measure_clipping("mlp", repeats=2)

    # Assert
    for mode in ("ghost", "per_sample"):
        assert len(result[mode]["rounds_s"]) == 2
        assert math.isfinite(result[mode]["round_s"]) and result[mode]["round_s"] > 0
        assert result[mode]["noise_s"] >= 0
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert math.isfinite(result["train_ratio"])
