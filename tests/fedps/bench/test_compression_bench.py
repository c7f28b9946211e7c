"""Tests for fedps.bench.compression_bench: its settings and its table (no runs)."""

from __future__ import annotations

import pytest

from fedps.bench.compression_bench import parse_settings, render_compression
from fedps.errors import ConfigError


def test_settings_are_densities_with_or_without_error_feedback_or_masked_training() -> None:
    # Execute
    settings = parse_settings("1, 0.1,0.1+ef,.25,0.2+mt,0.1+ef+mt")

    # Assert
    off = {"masked_training": False}
    assert settings == [
        {"density": 1.0, "error_feedback": False, **off},
        {"density": 0.1, "error_feedback": False, **off},
        {"density": 0.1, "error_feedback": True, **off},
        {"density": 0.25, "error_feedback": False, **off},
        {"density": 0.2, "error_feedback": False, "masked_training": True},
        {"density": 0.1, "error_feedback": True, "masked_training": True},
    ]
    for bad in ("", "0.1+feedback", "a", "0.1,-1", "0", "1.5+ef", "1+mt", "0.1+mt+ef", "mt"):
        with pytest.raises(ConfigError, match="--compression"):
            parse_settings(bad)


def test_settings_may_quantize_with_or_without_a_density() -> None:
    # Execute
    settings = parse_settings("8bit,0.1+ef+8bit,0.5+16bit")

    # Assert
    off = {"masked_training": False}
    assert settings == [
        {"density": 1.0, "error_feedback": False, "bits": 8, **off},
        {"density": 0.1, "error_feedback": True, "bits": 8, **off},
        {"density": 0.5, "error_feedback": False, "bits": 16, **off},
    ]
    for bad in ("8bits", "ef+8bit", "0.1+8", "+8bit", "17bit", "0bit", "0.1+8bit+ef"):
        with pytest.raises(ConfigError, match="--compression"):
            parse_settings(bad)


def test_the_table_compares_each_setting_with_the_first() -> None:
    # Prepare
    def summary(bytes_per_param: float, accuracy: list[float]) -> dict[str, object]:
        return {
            "bytes_per_param": bytes_per_param,
            "final_accuracy": accuracy,
            "max_epsilon": [7.21] * len(accuracy),
            "median_round_s": 0.5,
            "num_params": 4810,
            "runs": [],
        }

    results = {
        "jobs": {
            "digits": {
                "job": {},
                "failed": [{"setting": "0.5", "repeat": 1}],
                "settings": {"1": summary(12.0, [0.9, 0.92]), "0.1": summary(4.0, [0.88])},
            }
        }
    }

    # Execute
    table = render_compression(results).splitlines()

    # Assert
    assert "| 1 | 12.00 | 1.00x smaller | 90.0%, 92.0% | 91.0% | +0.0 pt |" in table[2]
    assert "| 0.1 | 4.00 | 3.00x smaller | 88.0% | 88.0% | -3.0 pt |" in table[3]
    assert "failed (repeat 1)" in table[4]
