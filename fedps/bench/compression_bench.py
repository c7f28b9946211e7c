"""``fedps bench --compression``: one job, secure, at several compression settings in turn.

Each repeat runs the job once per setting (``"1"``: whole updates; ``"0.1"``: density 0.1;
``"0.1+ef"``: density 0.1 with error feedback; ``"8bit"``: whole updates quantized to 8 bits and
packed, ``"0.1+ef+8bit"``: all three), one after the other, as ``fedps demo`` runs it
(:func:`fedps.bench.flower_comparison.run_fedps`), at the job's fixed noise multiplier, so every
setting spends the same epsilon. It reports per setting the bytes per parameter each client
pushed per round, the final accuracy and epsilon of each repeat, and the median round; and the
bytes and the accuracy against the first setting (whole updates, when listed first).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from fedps.bench.flower_comparison import Job, run_fedps
from fedps.config import CompressionConfig
from fedps.errors import ConfigError, FedPSError

__all__ = ["compare_compression", "parse_settings", "render_compression"]


def parse_settings(text: str) -> list[dict[str, object]]:
    """The ``[compression]`` sections of ``--compression`` (``"1,0.1+ef,8bit,0.1+ef+8bit"``).

    Each setting is spelt as :meth:`fedps.config.CompressionConfig.from_setting` reads it.

    Raises
    ------
    ConfigError
        A setting that is not ``DENSITY[+ef][+mt]``, ``Bbit`` or ``DENSITY[+ef][+mt]+Bbit``,
        a density outside (0, 1], bits outside [1, 16], or no setting.
    """
    settings: list[dict[str, object]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            setting = CompressionConfig.from_setting(part)
        except ValueError as exc:
            raise ConfigError(f"--compression {exc}") from None
        settings.append(setting.model_dump(exclude_none=True))
    if not settings:
        raise ConfigError("--compression needs at least one setting")
    return settings


def _name(setting: dict[str, object]) -> str:
    """A setting as given on the command line."""
    return CompressionConfig.model_validate(setting).setting


def compare_compression(
    jobs: Sequence[Job], settings: Sequence[dict[str, object]], *, repeats: int, console: Console
) -> dict[str, Any]:
    """Run each job secure at each setting, alternating, ``repeats`` times.

    Parameters
    ----------
    jobs
        The jobs (:data:`fedps.bench.flower_comparison.JOBS`).
    settings
        The ``[compression]`` sections (:func:`parse_settings`).
    repeats
        How many times each setting runs each job.
    console
        Where progress is printed.

    Returns
    -------
    dict
        ``{"jobs": {name: {"job", "settings": {setting: {"bytes_per_param",
        "final_accuracy", "max_epsilon", "median_round_s", "runs"}}, "failed"}}}``.

    Raises
    ------
    ConfigError
        ``repeats`` below 1.
    """
    if repeats < 1:
        raise ConfigError("repeats must be at least 1")
    out: dict[str, Any] = {"jobs": {}}
    for job in jobs:
        runs: dict[str, list[dict[str, Any]]] = {_name(s): [] for s in settings}
        failed: list[dict[str, Any]] = []
        for repeat in range(1, repeats + 1):
            for setting in settings:
                name = _name(setting)
                console.print(f"{job.name}: compression {name}, repeat {repeat} of {repeats} ...")
                try:
                    result, _ = run_fedps(job, encrypted=True, compression=setting)
                except FedPSError as exc:  # one failed run: the others still compare
                    console.print(f"  FAILED: {exc}", markup=False)
                    failed.append({"setting": name, "repeat": repeat, "error": str(exc)[-2000:]})
                    continue
                runs[name].append(result)
                console.print(
                    f"  {result['bytes_per_param']:.2f} bytes/param, accuracy "
                    f"{result['final_accuracy']}, epsilon {result['max_epsilon']:.2f}"
                )
        out["jobs"][job.name] = {
            "job": job.__dict__,
            "failed": failed,
            "settings": {
                name: {
                    "bytes_per_param": statistics.fmean(r["bytes_per_param"] for r in results),
                    "final_accuracy": [r["final_accuracy"] for r in results],
                    "max_epsilon": [r["max_epsilon"] for r in results],
                    "median_round_s": statistics.median(
                        s for r in results for s in r["round_seconds"][1:] or r["round_seconds"]
                    ),
                    "num_params": results[0]["num_params"],
                    "runs": results,
                }
                for name, results in runs.items()
                if results
            },
        }
    return out


def _mean_accuracy(summary: dict[str, Any]) -> float:
    """The mean final accuracy of a setting's runs (nan: none reported one)."""
    accuracies = [a for a in summary["final_accuracy"] if a is not None]
    return statistics.fmean(accuracies) if accuracies else float("nan")


def render_compression(results: dict[str, Any]) -> str:
    """The table of :func:`compare_compression`: each setting against the job's first."""
    lines = [
        "| job | compression | bytes/param (up) | vs first | accuracy | mean | vs first "
        "| epsilon | s/round |",
        "|---|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for name, job in results["jobs"].items():
        settings = job["settings"]
        base = next(iter(settings.values()), None)
        for setting, r in settings.items():
            assert base is not None
            accuracies = [a for a in r["final_accuracy"] if a is not None]
            mean, base_mean = _mean_accuracy(r), _mean_accuracy(base)
            smaller = base["bytes_per_param"] / r["bytes_per_param"]
            lines.append(
                f"| {name} ({r['num_params']:,} params) | {setting} | "
                f"{r['bytes_per_param']:.2f} | {smaller:.2f}x smaller | "
                f"{', '.join(f'{a:.1%}' for a in accuracies)} | {mean:.1%} | "
                f"{100 * (mean - base_mean):+.1f} pt | "
                f"{', '.join(f'{e:.2f}' for e in r['max_epsilon'])} | {r['median_round_s']:.3f} |"
            )
        for failure in job["failed"]:
            lines.append(f"| {name} | {failure['setting']} | failed (repeat {failure['repeat']}) |")
    return "\n".join(lines)
