"""``fedps bench --profile`` and ``--against flower`` without running anything: the phase
profile of a run's rounds, the alternation of the systems and the tables, on summaries made
up for the test."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from fedps.bench import flower_comparison
from fedps.bench.flower_comparison import Job, compare, job_named
from fedps.bench.report import render_comparison, render_profile
from fedps.bench.round_profile import phase_profile
from fedps.errors import ConfigError, PeerUnavailableError
from fedps.runtime.demo_summary import DemoSummary


def _summary(seconds: tuple[float, ...], train: tuple[float, ...]) -> DemoSummary:
    """A run of ``len(seconds)`` rounds of two clients; client-1 trains ``train`` seconds."""
    return DemoSummary(
        rounds=len(seconds),
        final_accuracy=0.9,
        max_epsilon=2.0,
        client_epsilons=(2.0, 2.0),
        client_noise_multipliers=(1.5, 1.5),
        delta=1e-5,
        noise="secure",
        bytes_pushed=1000 * len(seconds),
        seconds=sum(seconds),
        clients=2,
        shards=2,
        tls=True,
        abandoned_rounds=0,
        round_seconds=seconds,
        push_seconds=tuple(0.1 for _ in seconds),
        round_accuracy=tuple((s, 0.9) for s in seconds),
        round_contributors=tuple(2 for _ in seconds),
        round_phases=tuple({"open": 0.01, "train": t, "other": 0.1} for t in train),
        round_server_phases=tuple(
            {"commit_wait": t, **({"rotate": 0.5} if i == 2 else {})} for i, t in enumerate(train)
        ),
        round_client_phases=tuple(
            {"client-0": {"train": t / 2, "barrier": t / 2}, "client-1": {"train": t}}
            for t in train
        ),
    )


def test_a_profile_takes_each_phases_median_over_rounds_after_the_first() -> None:
    # Prepare: round 1 is slow (start-up); two runs of the same job
    runs = [_summary((9.0, 1.0, 2.0), (8.0, 0.5, 1.5)), _summary((9.0, 3.0), (8.0, 2.5))]
    # Execute
    profile = phase_profile(runs)
    # Assert
    assert profile["rounds"] == 3
    assert profile["round_s"] == 2.0
    assert profile["critical"] == {"open": 0.01, "train": 1.5, "other": 0.1}
    assert profile["server"]["rotate"] == 0.0  # one round of three rotated: median 0
    assert profile["clients"]["client-0"] == {"train": 0.75, "barrier": 0.75}
    assert list(profile["clients"]) == ["client-0", "client-1"]


def test_the_profile_table_lists_the_phases_in_round_order_per_system_and_client() -> None:
    # Prepare
    profiles = {
        "secure": phase_profile([_summary((9.0, 1.0), (8.0, 0.5))]),
        "plaintext": phase_profile([_summary((9.0, 0.8), (8.0, 0.4))]),
    }
    # Execute
    table = render_profile(profiles)
    # Assert
    lines = table.splitlines()
    assert lines[0].startswith("| phase | critical path (secure) | critical path (plaintext) |")
    assert "client-1 (secure)" in lines[0]
    phases = [line.split("|")[1].strip() for line in lines[2:7]]
    assert phases == ["open", "train", "barrier", "other", "**round (median)**"]
    assert "| train | 0.500 | 0.400 | 0.250 | 0.500 |" in lines
    assert "| commit_wait | 0.500 | 0.400 |" in lines


class _FakeRuns:
    """Stands in for the Flower process and the fedps demo, recording their order."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def flower(self, job: Job, *, clipping: str) -> dict[str, Any]:
        self.order.append({"per_sample": "flower", "ghost": "flower-ghost"}[clipping])
        return {
            "system": "flower",
            "num_params": 100,
            "round_seconds": [9.0, 0.5, 0.5],
            "median_round_s": 0.5,
            "final_accuracy": 0.9,
            "max_epsilon": 2.0,
            "bytes_per_param": 4.1,
        }

    def demo(
        self, config: Path | None, workdir: Path, overrides: Mapping[str, Any], **_: object
    ) -> DemoSummary:
        secure = overrides["he"]["enabled"]
        self.order.append("secure" if secure else "plaintext")
        summary = _summary((9.0, 1.0, 1.0), (8.0, 0.4, 0.4))
        return dataclasses.replace(
            summary, round_seconds=(9.0, 1.0, 1.0) if secure else (9, 0.75, 0.75)
        )


def test_a_comparison_alternates_the_systems_and_reports_fedps_over_flower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare
    fake = _FakeRuns()
    monkeypatch.setattr(flower_comparison, "run_flower", fake.flower)
    monkeypatch.setattr(flower_comparison, "run_demo", fake.demo)
    job = Job("tiny", model="mlp", rounds=3, clients=2)
    # Execute
    results = compare([job], flower=True, repeats=2, console=Console(quiet=True))
    # Assert
    assert fake.order == ["flower", "flower-ghost", "secure", "plaintext"] * 2
    tiny = results["jobs"]["tiny"]
    assert tiny["secure"]["vs_flower"] == 2.0
    assert tiny["plaintext"]["vs_flower"] == 1.5
    assert tiny["flower-ghost"]["vs_flower"] == 1.0  # a second baseline, beside the first
    assert tiny["secure"]["max_epsilon"] == [2.0, 2.0]
    assert tiny["secure"]["bytes_per_param"] == 1000 / 2 / tiny["secure"]["num_params"]
    assert tiny["profile"]["secure"]["rounds"] == 4  # rounds 2..3 of both repeats
    assert all(run["load"]["max"] >= run["load"]["min"] for run in tiny["flower"]["runs"])
    table = render_comparison(results)
    assert "| fedps secure | 1.000 | **2.00x** |" in table
    assert "| Flower + Opacus ghost | 0.500 | **1.00x** |" in table
    assert "Where a round of tiny goes" in table


def test_a_profile_alone_runs_fedps_only() -> None:
    fake = _FakeRuns()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flower_comparison, "run_demo", fake.demo)
        results = compare(
            [Job("tiny", "mlp", 3, clients=2)], flower=False, repeats=1, console=Console(quiet=True)
        )

    assert fake.order == ["secure", "plaintext"]
    assert "flower" not in results["jobs"]["tiny"]
    assert "vs_flower" not in results["jobs"]["tiny"]["secure"]


def test_jobs_are_named_and_their_rounds_can_be_changed() -> None:
    assert job_named("mlp1m").rounds == 10
    assert job_named("digits", 3) == Job("digits", "mlp", 3)
    with pytest.raises(ConfigError, match="unknown job"):
        job_named("resnet")
    with pytest.raises(ConfigError, match="repeats"):
        compare([], flower=True, repeats=0, console=Console(quiet=True))


def test_a_failed_run_is_reported_and_the_other_runs_still_compare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: the first secure run fails (a client crashed, the run timed out)
    fake = _FakeRuns()
    calls: list[str] = []

    def demo(config: Path | None, workdir: Path, overrides: Mapping[str, Any]) -> DemoSummary:
        calls.append("secure" if overrides["he"]["enabled"] else "plaintext")
        if calls.count("secure") == 1 and calls[-1] == "secure":
            raise PeerUnavailableError("every client exited before training finished")
        return fake.demo(config, workdir, overrides)

    monkeypatch.setattr(flower_comparison, "run_flower", fake.flower)
    monkeypatch.setattr(flower_comparison, "run_demo", lambda *a, **_: demo(*a))
    saved: list[int] = []
    # Execute
    results = compare(
        [Job("tiny", "mlp", 3, clients=2)],
        flower=True,
        repeats=2,
        console=Console(quiet=True),
        on_job=lambda so_far: saved.append(len(so_far["jobs"])),
    )
    # Assert
    tiny = results["jobs"]["tiny"]
    assert tiny["failed"] == [
        {"system": "secure", "repeat": 1, "error": "every client exited before training finished"}
    ]
    assert [run["repeat"] for run in tiny["secure"]["runs"]] == [2]
    assert len(tiny["plaintext"]["runs"]) == 2
    assert saved == [1]
    assert "| fedps secure | failed (repeat 1) |" in render_comparison(results)
