"""Tests for the parties' end-to-end rounds in ``fedps bench --parties``."""

from __future__ import annotations

import math
from typing import Any

import pytest
from rich.console import Console

from fedps.bench.flower_comparison import job_named
from fedps.bench.party_rounds import (
    compare_party_rounds,
    render_party_rounds,
    summarize_party_rounds,
)
from fedps.errors import InvalidArgumentError


def _run(repeat: int, rounds: list[float], decrypt: float) -> dict[str, Any]:
    return {
        "repeat": repeat,
        "round_seconds": rounds,
        "median_round_s": 0.0,
        "phases": {"fetch": 0.1, "verify": 0.2, "decrypt": decrypt},
        "final_accuracy": 0.9,
        "load": {"min": 1.0, "mean": 2.0, "max": 3.0},
    }


def test_the_summary_takes_medians_of_rounds_after_the_first_and_pairs_repeats() -> None:
    # Prepare: the first round of each run is slow and must not count
    runs = {
        "1": [_run(1, [9.0, 1.0, 1.0, 1.0], 0.2), _run(2, [9.0, 2.0, 2.0, 2.0], 0.4)],
        "3": [_run(1, [9.0, 1.1, 1.1, 1.1], 0.3), _run(2, [9.0, 2.4, 2.4, 2.4], 0.5)],
    }
    # Execute
    summary = summarize_party_rounds(runs, parties=3)
    # Assert
    assert summary["settings"]["1"]["median_round_s"] == 1.5
    assert summary["settings"]["3"]["median_round_s"] == pytest.approx(1.75)
    assert summary["ratio"] == pytest.approx(1.75 / 1.5)
    assert summary["paired_ratio"] == pytest.approx((1.1 + 1.2) / 2)
    assert summary["decrypt_added_s"] == pytest.approx(0.1)
    text = render_party_rounds(
        {"job": job_named("mlp1m").__dict__, "threshold": 2, "failed": [], **summary}
    )
    assert "P = 3: round 1.750 s" in text and "1.167" in text


def test_a_setting_without_a_run_leaves_the_ratio_unknown() -> None:
    summary = summarize_party_rounds({"1": [_run(1, [2.0, 1.0], 0.2)], "3": []}, parties=3)
    assert math.isnan(summary["ratio"]) and math.isnan(summary["paired_ratio"])
    assert list(summary["settings"]) == ["1"]


def test_the_rounds_need_parties_and_a_repeat() -> None:
    job = job_named("digits", 2)
    for parties, threshold, repeats in ((1, 1, 1), (3, 4, 1), (3, 2, 0)):
        with pytest.raises(InvalidArgumentError):
            compare_party_rounds(
                job, parties=parties, threshold=threshold, repeats=repeats, console=Console()
            )


@pytest.mark.slow
def test_secure_rounds_run_with_parties_and_with_one_key_holder() -> None:
    # Execute: the demo's model, two rounds, once each
    result = compare_party_rounds(
        job_named("digits", 2), parties=3, threshold=2, repeats=1, console=Console(quiet=True)
    )
    # Assert: both ran every round; the parties' run says it had three
    assert result["failed"] == []
    assert [r["keyholder_parties"] for r in result["settings"]["3"]["runs"]] == [3]
    assert [r["keyholder_parties"] for r in result["settings"]["1"]["runs"]] == [1]
    assert result["ratio"] > 0 and "decrypt" in result["settings"]["3"]["phases"]
