"""Tests for fedps.experiments.experiment (grid files, resumable sweeps) and
fedps.experiments.report.

Most sweep tests replace :func:`fedps.runtime.demo.run_demo` with a fake that returns a summary at
once; ``test_real_sweep_resumes`` runs the real platform for the encrypted point of a grid of
two tiny points (the real run of a point without encryption is
``tests/fedps/experiments/test_experiment_task.py``'s).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from fedps.errors import ConfigError, FedPSError
from fedps.experiments import experiment
from fedps.experiments.experiment import read_results, run_experiment
from fedps.experiments.grid import load_grid
from fedps.experiments.report import render_report
from fedps.runtime.demo import run_demo
from tests.fedps.experiments.fake_demo import FakeDemo
from tests.waiting import HANG_S

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "experiments"

TINY = """
[training]
rounds = 2
clients = 2
deadline_s = 30.0

[grid]
encryption = [true, false]
"""


def _write(tmp_path: Path, text: str, name: str = "grid.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _console() -> Console:
    return Console(file=io.StringIO(), width=200)


# ---------------------------------------------------------------------------- grid files


def test_grid_is_the_cartesian_product_with_stable_keys(tmp_path: Path) -> None:
    # Prepare
    path = _write(
        tmp_path,
        '[training]\nrounds = 3\n\n[grid]\nepsilon = [1, "inf"]\n'
        'partition = ["iid", "dirichlet:0.5"]\nencryption = [true, false]\n',
    )

    # Execute
    points = load_grid(path).points()

    # Assert
    keys = [p.key for p in points]
    assert len(points) == 8 and len(set(keys)) == 8
    assert keys[0] == "partition=iid,encryption=true,epsilon=1"
    assert keys == [p.key for p in load_grid(path).points()]  # stable
    by_key = {p.key: p for p in points}
    dirichlet = by_key["partition=dirichlet:0.5,encryption=false,epsilon=inf"].overrides
    assert dirichlet["training"] == {"rounds": 3, "partition": "dirichlet", "dirichlet_alpha": 0.5}
    assert dirichlet["he"] == {"enabled": False}
    assert dirichlet["privacy"]["target_epsilon"] is None
    assert float(str(dirichlet["privacy"]["noise_multiplier"])) == 0.0  # no DP: no noise
    eps1 = by_key["partition=iid,encryption=true,epsilon=1"].overrides["privacy"]
    assert eps1 == {"noise_multiplier": None, "target_epsilon": 1.0}


def test_dropout_axis_sets_the_chance_of_dying_mid_round(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[grid]\ndropout = [0.0, 0.3]\nseed = [0, 1]\n")

    # Execute
    points = load_grid(path).points()

    # Assert
    assert [p.key for p in points] == [
        "dropout=0,seed=0",
        "dropout=0,seed=1",
        "dropout=0.3,seed=0",
        "dropout=0.3,seed=1",
    ]
    assert points[3].overrides["training"] == {"dropout": 0.3, "seed": 1}
    with pytest.raises(ConfigError, match="dropout"):
        load_grid(_write(tmp_path, "[grid]\ndropout = [1.0]\n", "bad.toml"))


def test_compression_axis_sets_the_compression_section(tmp_path: Path) -> None:
    # Prepare: settings spelt as fedps bench --compression spells them; a base section
    path = _write(
        tmp_path,
        "[compression]\nbits = 16\n\n"
        '[grid]\ncompression = ["1", "0.10+ef", "8bit", "0.1+ef+8bit"]\nseed = [0]\n',
    )

    # Execute
    points = load_grid(path).points()

    # Assert: canonical keys; each point's section replaces the base's, bits included
    assert [p.key for p in points] == [
        "compression=1,seed=0",
        "compression=0.1+ef,seed=0",
        "compression=8bit,seed=0",
        "compression=0.1+ef+8bit,seed=0",
    ]
    sections = [p.overrides["compression"] for p in points]
    off = {"masked_training": False}
    assert sections[0] == {"density": 1.0, "error_feedback": False, "bits": None, **off}
    assert sections[1] == {"density": 0.1, "error_feedback": True, "bits": None, **off}
    assert sections[3] == {"density": 0.1, "error_feedback": True, "bits": 8, **off}


def test_centralised_points_hold_all_data_in_one_client(tmp_path: Path) -> None:
    # Prepare: the partition axis means nothing for the centralised baseline.
    path = _write(
        tmp_path,
        '[grid]\ncentralised = [true, false]\npartition = ["iid", "shard:2"]\nclients = [4]\n',
    )

    # Execute
    points = load_grid(path).points()

    # Assert
    assert [p.key for p in points] == [
        "centralised=true,partition=iid,clients=1",
        "centralised=false,partition=iid,clients=4",
        "centralised=false,partition=shard:2,clients=4",
    ]
    training = points[0].overrides["training"]
    assert training["clients"] == 1 and training["min_quorum"] == 1
    assert training["partition"] == "iid"
    assert points[2].overrides["training"]["shards_per_client"] == 2


def test_centralised_table_sets_the_baselines_own_training(tmp_path: Path) -> None:
    # Prepare: federated points train with batch 512; the baseline with its own recipe
    text = (
        "[training]\nbatch_size = 512\nlr = 4.0\n"
        "[centralised]\nbatch_size = 1024\nlr = 0.5\nmomentum = 0.9\n"
        "[grid]\ncentralised = [true, false]\nclients = [4]\n"
    )
    plain = _write(tmp_path, text.replace("momentum = 0.9", "momentum = 0.5"), "other.toml")

    # Execute
    grid = load_grid(_write(tmp_path, text))
    central, federated = grid.points()

    # Assert: only the centralised point takes the table; the sweep's digest covers it
    assert central.overrides["training"]["batch_size"] == 1024
    assert central.overrides["training"]["momentum"] == 0.9
    assert federated.overrides["training"]["batch_size"] == 512
    assert "momentum" not in federated.overrides["training"]
    assert grid.digest != load_grid(plain).digest
    bad = _write(tmp_path, text.replace("lr = 0.5", "lr = -1"), "bad.toml")
    with pytest.raises(ConfigError, match="grid point centralised=true"):
        load_grid(bad).points()


def test_clients_axis_lowers_the_quorum_when_needed(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[training]\nmin_quorum = 3\n\n[grid]\nclients = [2, 6]\n")

    # Execute
    small, large = load_grid(path).points()

    # Assert
    assert small.overrides["training"] == {"min_quorum": 2, "clients": 2}
    assert large.overrides["training"] == {"min_quorum": 3, "clients": 6}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[grid]\nrounds = [1]\n", "unknown grid axis rounds"),
        ("[grid]\nepsilon = [0]\n", "grid.epsilon"),
        ('[grid]\nepsilon = ["lots"]\n', "grid.epsilon"),
        ('[grid]\npartition = ["dirichlet:-1"]\n', "grid.partition"),
        ('[grid]\npartition = ["random"]\n', "grid.partition"),
        ('[grid]\nencryption = ["yes"]\n', "grid.encryption"),
        ("[grid]\nclients = []\n", "grid.clients"),
        ("[grid]\nseed = [1, 1]\n", "repeats a value"),
        ('[grid]\ncompression = ["0.1+8"]\n', "grid.compression"),
        ('[grid]\ncompression = ["1.5"]\n', "grid.compression"),
        ('[grid]\ncompression = ["0.1", "0.10"]\n', "repeats a value"),
        ('[grid]\ncompression = ["0.1"]\nmode = ["async"]\n', "needs training.mode"),
        ("[grid]\nepsilon = [1]\nnoise_multiplier = [1.0]\n", "not both"),
        ("[grid]\n", "at least one axis"),
        ("[training]\nrounds = 3\n", "no [grid] table"),
        ("[trainig]\nrounds = 3\n[grid]\nseed = [0]\n", "trainig"),
        ("[training]\nrounds = 0\n[grid]\nseed = [0]\n", "training.rounds"),
        ("[grid\n", "invalid TOML"),
    ],
)
def test_bad_grid_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    # Prepare
    path = _write(tmp_path, text)

    # Execute / Assert
    with pytest.raises(ConfigError, match=None) as caught:
        load_grid(path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_grid_file(tmp_path: Path) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match="not found"):
        load_grid(tmp_path / "absent.toml")


def test_every_shipped_grid_loads() -> None:
    # Prepare
    files = sorted(EXAMPLES.glob("*.toml"))

    # Execute
    grids = {path.stem: load_grid(path) for path in files}

    # Assert
    assert {"small", "fashion", "dropout"} <= set(grids)
    assert all(grid.points() for grid in grids.values())
    assert len(grids["small"].points()) == 16
    assert grids["fashion"].training["dataset"] == "fashion_mnist"
    assert any(p.axes.get("centralised") for p in grids["fashion"].points())
    assert {p.overrides["training"]["dropout"] for p in grids["dropout"].points()} == {0.0, 0.3}


# ---------------------------------------------------------------------------- sweeps


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A grid file (TINY unless rewritten) and where its sweep keeps its results."""

    grid: Path
    results: Path
    monkeypatch: pytest.MonkeyPatch

    def run(self, demo: Callable[..., Any] | None = None, **options: Any) -> list[dict[str, Any]]:
        """Sweep the grid, with ``demo`` standing in for the platform from now on if given."""
        if demo is not None:
            self.monkeypatch.setattr(experiment, "run_demo", demo)
        return run_experiment(self.grid, self.results, console=_console(), **options)


@pytest.fixture
def sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sweep:
    return Sweep(_write(tmp_path, TINY), tmp_path / "out" / "results.jsonl", monkeypatch)


def test_sweep_records_points_and_skips_them_on_resume(tmp_path: Path, sweep: Sweep) -> None:
    # Prepare
    fake = FakeDemo()

    # Execute
    first = sweep.run(fake, workdir=tmp_path / "work")
    second = sweep.run()

    # Assert
    assert len(fake.calls) == 2  # the second sweep ran nothing
    assert first == second
    assert [r["key"] for r in first] == ["encryption=true", "encryption=false"]
    assert first[0]["final_accuracy"] == 0.9 and first[0]["encryption"] is True
    assert first[0]["clients"] == 2 and first[0]["epsilon"] == 7.5
    assert first[0]["round_accuracy"] == [0.7, 0.9]
    assert len(sweep.results.read_text().splitlines()) == 2
    csv = sweep.results.with_suffix(".csv").read_text().splitlines()
    assert csv[0].startswith("key,") and len(csv) == 3


def test_sweep_runs_only_points_missing_from_the_results(sweep: Sweep) -> None:
    # Prepare: a results file whose last line an interrupted write cut short.
    sweep.run(FakeDemo())
    first_line = sweep.results.read_text().splitlines()[0]
    sweep.results.write_text(first_line + "\n" + '{"key": "encryption=fal')
    fake = FakeDemo()

    # Execute
    records = sweep.run(fake)

    # Assert
    assert len(fake.calls) == 1
    assert fake.calls[0]["he"] == {"enabled": False}
    assert [r["key"] for r in records] == ["encryption=true", "encryption=false"]
    assert [r["key"] for r in read_results(sweep.results)] == [
        "encryption=true",
        "encryption=false",
    ]


def test_failed_point_is_recorded_and_retried(sweep: Sweep) -> None:
    # Prepare
    failed = sweep.run(FakeDemo(fail=("encryption=true",)))
    retry = FakeDemo()

    # Execute
    records = sweep.run(retry)

    # Assert
    assert "every client exited" in failed[0]["error"]
    assert "error" not in failed[1]  # the sweep went on
    assert len(retry.calls) == 1 and retry.calls[0]["he"] == {"enabled": True}
    assert all("error" not in r for r in records)
    assert len(sweep.results.read_text().splitlines()) == 3  # the retry superseded the failure


def test_resume_refuses_results_of_another_base_configuration(sweep: Sweep) -> None:
    # Prepare
    sweep.run(FakeDemo())
    sweep.grid.write_text(TINY.replace("rounds = 2", "rounds = 5"))

    # Execute / Assert
    with pytest.raises(ConfigError, match="another base configuration"):
        sweep.run()


@pytest.mark.integration
@pytest.mark.slow
def test_real_sweep_resumes(sweep: Sweep) -> None:
    # Prepare: the real platform for the encrypted point, the fake for the other
    plaintext = FakeDemo()

    def platform(config: Path | None, workdir: Path, overrides: Any, **kwargs: Any) -> Any:
        if overrides.get("he", {}).get("enabled"):
            return run_demo(config, workdir, overrides, **kwargs)
        return plaintext(config, workdir, overrides, **kwargs)

    # Execute: the sweep; again; then a file with only the first point done.
    records = sweep.run(platform, point_timeout_s=HANG_S)  # a hang guard, not a pace
    lines = sweep.results.read_text().splitlines()
    again = sweep.run(FakeDemo(fail=("encryption=true",)))
    sweep.results.write_text(lines[0] + "\n")
    fake = FakeDemo()
    resumed = sweep.run(fake)

    # Assert: the real point's record
    assert all("error" not in r for r in records), records
    real = records[0]
    assert real["key"] == "encryption=true" and real["encryption"] is True
    assert 0.3 < real["final_accuracy"] <= 1.0
    assert 0 < real["max_epsilon"] <= 7.5 and real["delta"] == 1e-5
    assert real["bytes_pushed"] > 0 and real["rounds"] == 2
    assert len(real["client_noise_multipliers"]) == 2
    # every client's own epsilon, as it reported it to the coordinator
    assert len(real["client_epsilons"]) == 2
    assert max(real["client_epsilons"]) == pytest.approx(real["max_epsilon"], abs=1e-3)
    # ... and the resumes
    assert len(plaintext.calls) == 1
    assert again == records  # nothing was rerun: the fake would have failed a point
    assert len(fake.calls) == 1 and fake.calls[0]["he"] == {"enabled": False}
    assert resumed[0] == records[0]


# ---------------------------------------------------------------------------- report


def _record(key: str, **fields: Any) -> dict[str, Any]:
    base = {
        "key": key,
        "dataset": "digits",
        "model": "mlp",
        "rounds": 10,
        "centralised": False,
        "partition": "iid",
        "clients": 4,
        "mode": "sync",
        "encryption": True,
        "seed": 0,
        "epsilon": 1.0,
        "noise_multiplier": 1.2,
        "final_accuracy": 0.8,
        "max_epsilon": 0.99,
        "delta": 1e-5,
        "seconds": 30.0,
        "bytes_pushed": 2_000_000,
    }
    return {**base, **fields}


def _results_file(tmp_path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """A results file holding ``records``, one JSON line each."""
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sample_results(tmp_path: Path) -> Path:
    records = [
        _record(
            f"centralised=false,partition={part},encryption={str(enc).lower()},epsilon={eps}",
            partition=part,
            encryption=enc,
            epsilon=eps if eps == "inf" else float(eps),
            final_accuracy=acc + (0.0 if enc else 0.002),
            noise_multiplier=0.0 if eps == "inf" else 1.2,
        )
        for part, acc in (("iid", 0.8), ("dirichlet:0.5", 0.7))
        for enc in (True, False)
        for eps in ("1", "8", "inf")
    ]
    records.append(
        _record(
            "centralised=true,partition=iid,encryption=true,epsilon=1",
            centralised=True,
            clients=1,
            final_accuracy=0.85,
        )
    )
    records.append(
        _record(
            "centralised=false,partition=iid,encryption=true,epsilon=4",
            epsilon=4.0,
            final_accuracy=None,
            error="PeerUnavailableError: every client exited",
        )
    )
    return _results_file(tmp_path, reversed(records))


def test_report_lists_every_point_sorted_and_draws_plots(tmp_path: Path) -> None:
    # Prepare
    results = _sample_results(tmp_path)

    # Execute
    report = render_report(results, tmp_path / "report")

    # Assert
    text = report.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    table = [r for r in rows if r.split("|")[1].strip() in ("iid", "dirichlet:0.5")]
    assert len(table) == 13
    assert rows[1].startswith("| centralised (iid) | 1 |")
    assert table[0].startswith("| dirichlet:0.5 |")
    epsilons = [r.split("|")[6].strip() for r in table[:3]]
    assert epsilons == ["1.00", "8.00", "∞"]
    assert " on " in table[0] and " off " in table[3]
    assert "every client exited" in text
    assert "Largest |Δ|: 0.20 points." in text
    for name in ("accuracy_vs_epsilon.png", "time_per_point.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
        assert f"]({name})" in text


def test_report_plots_accuracy_against_bytes_over_compression_settings(tmp_path: Path) -> None:
    # Prepare: three compression settings at two epsilons
    records = [
        _record(
            f"compression={setting},epsilon={eps:g}",
            compression=setting,
            epsilon=eps,
            bytes_pushed=megabytes * 1_000_000,
            final_accuracy=accuracy - (0.05 if eps == 1.0 else 0.0),
        )
        for setting, megabytes, accuracy in (
            ("1", 12.0, 0.92),
            ("8bit", 9.0, 0.92),
            ("0.1+ef", 4.0, 0.9),
        )
        for eps in (1.0, 8.0)
    ]
    results = _results_file(tmp_path, records)

    # Execute
    text = render_report(results, tmp_path / "report").read_text()

    # Assert: a compression column, and the plot of accuracy against bytes
    assert "| encryption | compression | ε target |" in text
    assert "| on | 0.1+ef | 1.00 |" in text
    png = tmp_path / "report" / "accuracy_vs_bytes.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "](accuracy_vs_bytes.png)" in text


def test_report_without_a_compression_axis_draws_no_bytes_plot(tmp_path: Path) -> None:
    # Prepare / Execute
    text = render_report(_sample_results(tmp_path), tmp_path / "report").read_text()

    # Assert
    assert "compression" not in text
    assert not (tmp_path / "report" / "accuracy_vs_bytes.png").exists()


@pytest.mark.parametrize(
    ("task", "words"),
    [("digits", "digits, model mlp,"), ("wine_task.classify", "task wine_task.classify,")],
)
def test_report_names_the_task_it_trained(tmp_path: Path, task: str, words: str) -> None:
    # Prepare: a built-in dataset's point, or a user's task (which brings its own model)
    results = _results_file(tmp_path, [_record("epsilon=inf", task=task, epsilon=math.inf)])

    # Execute
    text = render_report(results, tmp_path / "report").read_text()

    # Assert: the task in words, and no DP said as what it is (noise 0, no stand-in)
    assert f"1 points (0 failed), {words} 10 rounds" in text
    assert "model mlp" not in text or task == "digits"
    assert "noise multiplier 0" in text and "1e-3" not in text


def test_report_summarises_seeds_and_shows_dropout(tmp_path: Path) -> None:
    # Prepare: two seeds with and without dropouts, one of them failed
    records = [
        _record(
            f"dropout={drop:g},seed={seed}",
            dropout=drop,
            seed=seed,
            final_accuracy=acc,
            **({"error": "PeerUnavailableError: gone"} if acc is None else {}),
        )
        for drop, seed, acc in (
            (0.0, 0, 0.90),
            (0.0, 1, 0.94),
            (0.3, 0, 0.91),
            (0.3, 1, 0.93),
            (0.3, 2, None),
        )
    ]
    results = _results_file(tmp_path, records)

    # Execute
    text = render_report(results, tmp_path / "report").read_text()

    # Assert: a dropout column; mean, sd and range over the seeds that succeeded
    assert "| mode | dropout | seed |" in text
    assert "| iid | 4 | sync | 0.3 | 1 |" in text
    assert "| dropout=0 | 2 | 92.00 | 2.83 | 90.00 - 94.00 |" in text
    assert "| dropout=0.3 | 2 | 92.00 | 1.41 | 91.00 - 93.00 |" in text


@pytest.mark.parametrize(
    ("noises", "line"),
    [
        (["secure", "secure"], "secure (a CSPRNG) at every point"),
        (["secure", "insecure-reproducible"], "**1 of 2 points drew their DP noise from"),
        (["secure", None], "**1 of 2 points drew their DP noise from"),  # before the CSPRNG
    ],
)
def test_report_says_where_the_noise_came_from(
    tmp_path: Path, noises: list[str | None], line: str
) -> None:
    # Prepare
    records = [
        _record(f"seed={i}", seed=i, **({} if noise is None else {"noise": noise}))
        for i, noise in enumerate(noises)
    ]
    results = _results_file(tmp_path, records)

    # Execute
    text = render_report(results, tmp_path / "report").read_text()

    # Assert
    assert line in text


def test_report_of_missing_or_empty_results_fails(tmp_path: Path) -> None:
    # Prepare
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")

    # Execute / Assert
    with pytest.raises(FedPSError, match="not found"):
        render_report(tmp_path / "absent.jsonl", tmp_path / "out")
    with pytest.raises(FedPSError, match="no results"):
        render_report(empty, tmp_path / "out")


def test_infinite_epsilon_is_written_as_inf(sweep: Sweep) -> None:
    # Prepare: "no DP" points report an astronomically large epsilon, some values are inf.
    sweep.grid.write_text('[grid]\nepsilon = ["inf"]\n')
    fake = FakeDemo()

    # Execute
    (record,) = sweep.run(lambda *a, **k: dataclasses.replace(fake(*a, **k), max_epsilon=math.inf))

    # Assert
    line = json.loads(sweep.results.read_text())
    assert record["epsilon"] == "inf" == line["epsilon"]
    assert line["max_epsilon"] == "inf"
    assert "Infinity" not in sweep.results.read_text()


#: A grid whose point labels are longer than a terminal is wide.
WIDE = TINY.replace(
    "[grid]\n",
    '[grid]\npartition = ["dirichlet:0.5"]\nnoise_multiplier = [1.25]\nseed = [12345, 67890]\n'
    "clients = [2]\ndropout = [0.3]\n",
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_progress_fits_an_80_column_terminal(sweep: Sweep, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a terminal 80 columns wide, points labelled with more than 80 characters
    sweep.grid.write_text(WIDE)
    monkeypatch.setenv("COLUMNS", "80")
    screen = io.StringIO()
    monkeypatch.setattr(experiment, "run_demo", FakeDemo())

    # Execute: every point's summary line redraws the bar with the point's label
    run_experiment(sweep.grid, sweep.results, console=Console(file=screen, force_terminal=True))

    # Assert: no line is wider than the terminal; the bar and its counter stay in view, below
    # the last point's label (cut short)
    lines = [_ANSI.sub("", line) for line in re.split(r"[\r\n]", screen.getvalue())]
    last = read_results(sweep.results)[-1]["key"]
    assert len(last) > 80
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    shown = lines.index(next(line for line in lines if re.search(r" 4/4 points \S+ \S+$", line)))
    assert lines[shown].startswith("━" * 40), lines[shown]
    assert lines[shown - 1] == last[:79] + "…"
