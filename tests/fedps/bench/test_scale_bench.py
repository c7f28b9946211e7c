"""``fedps bench --scale`` at toy scale: real servers under mutual TLS, 3 replaying clients of
the small demo model in one host process, one round; every role is measured (no figure is
compared with another: they are timings)."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from fedps.bench.scale_bench import render_scale, run_scale_bench

_ROLES = {"clients", "coordinator", "keyholder", "shard-0", "shard-1"}


@pytest.mark.slow
@pytest.mark.integration
def test_a_toy_scale_run_measures_every_role() -> None:
    # Execute
    result = run_scale_bench(clients=3, model="mlp", rounds=1, hosts=1, console=Console(quiet=True))

    # Assert
    (round_,) = result["rounds"]
    assert round_["contributors"] == 3 and not round_["abandoned"]
    assert round_["bytes_per_client"] > 0 and math.isfinite(round_["seconds"])
    assert {k.removeprefix("cpu_s.") for k in round_ if k.startswith("cpu_s.")} == _ROLES
    assert round_["cpu_s.clients"] > 0  # their setup and their encryption
    assert set(result["peak_rss_mib"]) == _ROLES
    assert all(mib > 0 for mib in result["peak_rss_mib"].values())
    assert "| 3 x 4,810 | 1 |" in render_scale([result])
