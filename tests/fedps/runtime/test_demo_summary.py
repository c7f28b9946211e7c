"""Tests for fedps.runtime.demo_summary: the record ``fedps demo --json`` writes."""

from __future__ import annotations

import dataclasses
import json

from tests.fedps.experiments.fake_demo import SUMMARY


def test_to_json_writes_every_field_under_its_name_with_tuples_as_arrays() -> None:
    # Prepare
    summary = dataclasses.replace(
        SUMMARY,
        final_accuracy=None,
        max_epsilon=float("inf"),
        client_epsilons=(1.5, 2.0),
        client_noise_multipliers=(1.1, 1.1),
        seconds=3.25,
        tls=True,
        round_seconds=(1.0, 1.5),
        push_seconds=(0.25, 0.5),
        round_accuracy=((1.0, None), (1.5, 0.875)),
        round_contributors=(2, 2),
        round_phases=({"train": 0.5, "other": 0.5}, {"train": 1.0, "other": 0.5}),
        round_server_phases=({"commit_wait": 0.75}, {"commit_wait": 1.25}),
        round_client_phases=({"client-0": {"train": 0.5}}, {"client-0": {"train": 1.0}}),
        keyholder_parties=3,
    )

    # Execute
    text = summary.to_json()

    # Assert
    assert text.endswith("}\n")
    assert json.loads(text) == {
        "rounds": 2,
        "final_accuracy": None,
        "max_epsilon": float("inf"),
        "client_epsilons": [1.5, 2.0],
        "client_noise_multipliers": [1.1, 1.1],
        "delta": 1e-5,
        "noise": "secure",
        "bytes_pushed": 1000,
        "seconds": 3.25,
        "clients": 2,
        "shards": 1,
        "tls": True,
        "abandoned_rounds": 0,
        "round_seconds": [1.0, 1.5],
        "push_seconds": [0.25, 0.5],
        "round_accuracy": [[1.0, None], [1.5, 0.875]],
        "round_contributors": [2, 2],
        "round_phases": [{"train": 0.5, "other": 0.5}, {"train": 1.0, "other": 0.5}],
        "round_server_phases": [{"commit_wait": 0.75}, {"commit_wait": 1.25}],
        "round_client_phases": [{"client-0": {"train": 0.5}}, {"client-0": {"train": 1.0}}],
        "keyholder_parties": 3,
    }
