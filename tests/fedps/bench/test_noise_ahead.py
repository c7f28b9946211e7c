"""``fedps bench``'s DP-SGD round with its noise drawn ahead against on demand, on the small
demo model: every figure is there, and the rounds drawn ahead took all their noise from the
pool (no figure is compared with another: they are timings)."""

from __future__ import annotations

import math

from fedps.bench.noise_ahead import measure_noise_ahead


def test_a_round_drawn_ahead_takes_all_its_noise_from_the_pool() -> None:
    # Execute
    result = measure_noise_ahead("mlp", repeats=1)

    # Assert
    assert result["from_pool"] == 1.0
    assert result["arrays"] > 0 and result["values"] >= result["arrays"]
    for key in ("round_s_on_demand", "round_s_ahead", "noise_s_on_demand", "fill_s", "ratio"):
        assert math.isfinite(result[key]) and result[key] > 0
    assert result["noise_s_ahead"] >= 0
