"""The Flower baseline of ``fedps bench --against flower`` on a tiny job: Flower's plain FedAvg
with Opacus, through Flower's simulation runtime (Ray), in the process group the bench starts
and ends, trains and reports its rounds, epsilon and bytes."""

from __future__ import annotations

import math

import pytest

from fedps.bench.flower_comparison import Job, run_flower

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.usefixtures("one_ray_node")
def test_flower_fedavg_with_opacus_trains_and_reports_its_rounds() -> None:
    # Prepare: 2 clients, 2 rounds of the digits MLP
    job = Job("tiny", model="mlp", rounds=2, clients=2)
    # Execute
    result = run_flower(job)
    # Assert
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert all(r["clients"] == 2 and r["seconds"] > 0 for r in result["rounds"])
    epsilons = [r["max_epsilon"] for r in result["rounds"]]
    assert 0 < epsilons[0] < epsilons[1] < math.inf  # one accountant per node, across rounds
    assert result["max_epsilon"] == epsilons[1]
    assert result["num_params"] == 4810
    assert 4.0 <= result["bytes_per_param"] < 4.5  # float32, and the arrays' headers
    assert 0.0 <= result["final_accuracy"] <= 1.0
    assert result["median_round_s"] == result["round_seconds"][1]
