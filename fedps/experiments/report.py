"""``fedps experiment report``: a results file as a markdown table and two plots.

``report.md`` lists every point (sorted: centralised baseline, partition, encryption on before
off, epsilon rising), the accuracy difference that encryption makes at each matching point,
accuracy over seeds (mean and spread) where a point ran with several, and embeds
``accuracy_vs_epsilon.png`` (one line per partition, encryption on solid and off dashed,
"no DP" at the right edge, the mean over seeds with their standard deviation as error bars)
and ``time_per_point.png``; a sweep over the compression axis adds ``accuracy_vs_bytes.png``
(accuracy against the bytes the clients pushed, one line per epsilon). Plots are drawn with
matplotlib's Agg canvas, so no display is needed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from fedps.errors import FedPSError
from fedps.experiments.experiment import read_results

__all__ = ["render_report"]

_ACCURACY_PNG = "accuracy_vs_epsilon.png"
_TIME_PNG = "time_per_point.png"
_BYTES_PNG = "accuracy_vs_bytes.png"
_CENTRALISED = "centralised"


def _float(value: object) -> float | None:
    """A record's number; ``"inf"`` is infinity, anything else not a number is ``None``."""
    if value == "inf":
        return math.inf
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _eps(value: object) -> str:
    number = _float(value)
    if number is None:
        return "-"
    if math.isinf(number):
        return "∞"
    return f"{number:.3g}" if number >= 1e4 else f"{number:.2f}"


def _succeeded(record: Mapping[str, Any]) -> bool:
    return "error" not in record and _float(record.get("final_accuracy")) is not None


def _x(record: Mapping[str, Any]) -> float | None:
    """Where a point sits on the epsilon axis: its target, else the epsilon it spent."""
    target = _float(record.get("epsilon"))
    return target if target is not None else _float(record.get("max_epsilon"))


def _varying(records: Sequence[Mapping[str, Any]], field: str) -> bool:
    return len({str(r.get(field)) for r in records if not r.get("centralised")}) > 1


def _series(record: Mapping[str, Any], varying: Sequence[str]) -> str:
    """The line a point belongs to (encryption aside): its partition, or the baseline."""
    if record.get("centralised"):
        return _CENTRALISED
    name = str(record.get("partition", "?"))
    if "clients" in varying:
        name += f", {record.get('clients')} clients"
    if "mode" in varying:
        name += f", {record.get('mode')}"
    if "dropout" in varying:
        name += f", dropout {_float(record.get('dropout')) or 0:g}"
    if "compression" in varying:
        name += f", compression {record.get('compression', '1')}"
    return name


def _plot_accuracy(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Accuracy against epsilon: one colour per partition, encryption on solid, off dashed."""
    ok = [r for r in records if _succeeded(r) and (_x(r) or 0) > 0]
    varying = [f for f in ("clients", "mode", "dropout", "compression") if _varying(ok, f)]
    finite = sorted({x for r in ok if (x := _x(r)) is not None and math.isfinite(x)})
    right = finite[-1] * 2 if finite else 1.0  # where "no DP" sits
    points: dict[tuple[str, bool], dict[float, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in ok:
        x = _x(r)
        assert x is not None
        key = (_series(r, varying), bool(r.get("encryption")))
        points[key][right if math.isinf(x) else x].append(float(r["final_accuracy"]))
    names = sorted({name for name, _ in points}, key=lambda n: (n != _CENTRALISED, n))
    colours = {n: f"C{i}" for i, n in enumerate(n for n in names if n != _CENTRALISED)}
    colours[_CENTRALISED] = "black"
    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, encrypted in sorted(points, key=lambda k: (names.index(k[0]), not k[1])):
        by_x = points[(name, encrypted)]
        xs = sorted(by_x)
        ys = [100 * sum(by_x[x]) / len(by_x[x]) for x in xs]  # mean over seeds
        errors = [100 * _sd(by_x[x]) for x in xs]  # their spread (0 for one seed)
        ax.errorbar(  # plaintext: dashed, hollow and larger, so it shows over an equal line
            xs,
            ys,
            yerr=errors if any(errors) else None,
            capsize=4,
            linestyle="-" if encrypted else "--",
            marker="*" if name == _CENTRALISED else ("o" if encrypted else "s"),
            markersize=(12 if name == _CENTRALISED else 5) + (0 if encrypted else 4),
            markerfacecolor=colours[name] if encrypted else "none",
            color=colours[name],
            label=f"{name}, {'encrypted' if encrypted else 'plaintext'}",
        )
    _epsilon_axis(ax, finite, right, has_inf=any(math.isinf(_x(r) or 0) for r in ok))
    delta = next((r.get("delta") for r in ok if r.get("delta")), None)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs privacy" + (f" (δ = {delta:g})" if delta else ""))
    ax.grid(True, alpha=0.3)
    if points:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_bytes(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Accuracy against the megabytes the clients pushed, one point per compression setting.

    One line per epsilon (and partition, encryption), through its settings in order of bytes,
    each point named by its setting.
    """
    ok = [r for r in records if _succeeded(r) and not r.get("centralised")]
    varying = [f for f in ("clients", "mode", "dropout") if _varying(ok, f)]
    lines: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        line = f"{_series(r, varying)}, ε {_eps(_x(r))}"
        if not r.get("encryption"):
            line += ", plaintext"
        megabytes = (_float(r.get("bytes_pushed")) or 0.0) / 1e6
        lines[line][str(r.get("compression", "1"))].append((megabytes, float(r["final_accuracy"])))
    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (line, by_setting) in enumerate(sorted(lines.items())):
        points = sorted(  # mean over seeds, by bytes
            (
                sum(mb for mb, _ in runs) / len(runs),
                100 * sum(a for _, a in runs) / len(runs),
                setting,
            )
            for setting, runs in by_setting.items()
        )
        xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=line)
        for x, y, setting in points:
            ax.annotate(setting, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    plain = FuncFormatter(lambda x, _: f"{x:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set_xlabel("megabytes pushed by the clients over the run (log)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs bytes (compression settings)")
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _epsilon_axis(ax: Axes, finite: list[float], right: float, *, has_inf: bool) -> None:
    """Log-scaled epsilon ticks, with "no DP" at the right edge when some point has no noise."""
    ax.set_xscale("log")
    ticks = finite if len(finite) <= 8 else []
    labels = [f"{x:g}" for x in ticks]
    if has_inf:
        ticks, labels = [*ticks, right], [*labels, "∞\n(no DP)"]
        if finite:
            ax.axvline(math.sqrt(finite[-1] * right), color="grey", linestyle=":", linewidth=1)
    if ticks:
        ax.set_xticks(ticks, labels)
        ax.minorticks_off()
    ax.set_xlabel("ε (target; ε spent where the grid sets the noise multiplier)")


def _plot_time(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Seconds per point (start-up included), one horizontal bar per point."""
    fig = Figure(figsize=(8.0, 1.5 + 0.32 * max(1, len(records))))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    seconds = [_float(r.get("seconds")) or 0.0 for r in records]
    colours = [
        "tab:red" if "error" in r else ("tab:blue" if r.get("encryption") else "tab:orange")
        for r in records
    ]
    ax.barh(range(len(records)), seconds, color=colours)
    ax.set_yticks(range(len(records)), _short_keys(records), fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("seconds per point (processes start, train, stop)")
    ax.set_title(f"{len(records)} points, {sum(seconds) / 60:.1f} min in all", fontsize="medium")
    legend = [("tab:blue", "encrypted"), ("tab:orange", "plaintext"), ("tab:red", "failed")]
    ax.legend(
        handles=[Patch(color=c, label=label) for c, label in legend],
        fontsize="small",
        loc="lower right",
    )
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _short_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Point keys without the axis values every point shares (``clients=4`` for all)."""
    parts = [str(r["key"]).split(",") for r in records]
    shared = set.intersection(*(set(p) for p in parts)) if parts else set()
    return [",".join(x for x in p if x not in shared) or ",".join(p) for p in parts]


def _noise_line(records: Sequence[Mapping[str, Any]]) -> str:
    """How the points drew their DP noise: secure, reproducible, or seeded by an earlier fedps.

    Secure is a CSPRNG, reproducible is from the seed; records without a ``noise`` field predate the
    CSPRNG.
    """
    modes = [str(r.get("noise", "seeded")) for r in records]
    if all(m == "secure" for m in modes):
        return "DP noise, Poisson and cohort sampling: secure (a CSPRNG) at every point."
    seeded = sum(1 for m in modes if m != "secure")
    return (
        f"**{seeded} of {len(records)} points drew their DP noise from the configured seed "
        "(`privacy.insecure_reproducible`, or a fedps from before the CSPRNG: no `noise` "
        "field): their epsilon holds against no one who knows the configuration.**"
    )


def _table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    errors = any("error" in r for r in records)
    dropouts = any(_float(r.get("dropout")) for r in records)  # a column only if some are set
    compression = any(r.get("compression", "1") != "1" for r in records)  # likewise
    head = (
        "| partition | clients | mode |"
        + (" dropout |" if dropouts else "")
        + " seed | encryption |"
        + (" compression |" if compression else "")
        + " ε target | noise mult. | accuracy (%) |"
        " ε spent (max) | δ | time (s) | pushed (MB) |"
    )
    columns = 12 + dropouts + compression + errors
    lines = [head + (" error |" if errors else ""), "|---" * columns + "|"]
    for r in records:
        accuracy = _float(r.get("final_accuracy"))
        sigma = _float(r.get("noise_multiplier"))
        delta = _float(r.get("delta"))
        row = [
            f"{_CENTRALISED} (iid)" if r.get("centralised") else str(r.get("partition", "-")),
            str(r.get("clients", "-")),
            str(r.get("mode", "-")),
            *([f"{_float(r.get('dropout')) or 0:g}"] if dropouts else []),
            str(r.get("seed", "-")),
            "on" if r.get("encryption") else "off",
            *([str(r.get("compression", "1"))] if compression else []),
            _eps(r.get("epsilon")),
            "-" if sigma is None else f"{sigma:.3f}",
            "-" if accuracy is None else f"{100 * accuracy:.2f}",
            _eps(r.get("max_epsilon")),
            "-" if delta is None else f"{delta:g}",
            f"{_float(r.get('seconds')) or 0:.1f}",
            f"{(_float(r.get('bytes_pushed')) or 0) / 1e6:.2f}",
        ]
        if errors:
            error = str(r.get("error") or "").partition("\n")[0]
            row.append(error[:120].replace("|", "/"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _encryption_pairs(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Accuracy with encryption minus without, for points that differ only in encryption."""
    by_rest: dict[str, dict[bool, Mapping[str, Any]]] = defaultdict(dict)
    for r in records:
        if _succeeded(r) and "encryption=" in str(r["key"]):
            rest = ",".join(p for p in str(r["key"]).split(",") if not p.startswith("encryption="))
            by_rest[rest][bool(r.get("encryption"))] = r
    diffs = {
        rest: 100 * (float(pair[True]["final_accuracy"]) - float(pair[False]["final_accuracy"]))
        for rest, pair in by_rest.items()
        if len(pair) == 2
    }
    if not diffs:
        return []
    return [
        "",
        "## Encryption on minus off",
        "",
        "Accuracy points at otherwise identical points (same seed and data; the same DP noise "
        "only with `privacy.insecure_reproducible`, a fresh draw otherwise).",
        "",
        "| point | Δ accuracy (points) |",
        "|---|---:|",
        *(f"| {rest or '(base)'} | {diff:+.2f} |" for rest, diff in diffs.items()),
        "",
        f"Largest |Δ|: {max(abs(d) for d in diffs.values()):.2f} points.",
    ]


def _sd(values: Sequence[float]) -> float:
    """Sample standard deviation (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _over_seeds(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Accuracy over seeds (mean, standard deviation, range) of points that differ only in seed.

    Nothing when no point ran with more than one seed.
    """
    by_rest: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if _succeeded(r):
            rest = ",".join(p for p in str(r["key"]).split(",") if not p.startswith("seed="))
            by_rest[rest].append(100 * float(r["final_accuracy"]))
    rows = []
    for rest, accuracies in by_rest.items():
        if len(accuracies) < 2:
            continue
        mean = sum(accuracies) / len(accuracies)
        rows.append(
            f"| {rest or '(base)'} | {len(accuracies)} | {mean:.2f} | {_sd(accuracies):.2f} | "
            f"{min(accuracies):.2f} - {max(accuracies):.2f} |"
        )
    if not rows:
        return []
    return [
        "",
        "## Over seeds",
        "",
        "Points that differ only in their seed: test accuracy (%) over the seeds that succeeded "
        "(sample standard deviation).",
        "",
        "| point | seeds | mean | sd | min - max |",
        "|---|---:|---:|---:|---|",
        *rows,
    ]


def _task_words(record: Mapping[str, object]) -> str:
    """What a point trained, in words.

    A built-in dataset with its model, or the user's task (``task.app``), which brings its own.
    """
    dataset, task = record.get("dataset", "?"), record.get("task")
    if task and task != dataset:
        return f"task {task}"
    return f"{dataset}, model {record.get('model', '?')}"


def render_report(results_path: Path, out_dir: Path) -> Path:
    """Write ``report.md`` and its plots for a results file; return the report's path.

    Parameters
    ----------
    results_path
        JSON lines written by :func:`fedps.experiments.experiment.run_experiment`.
    out_dir
        Created if needed; ``report.md``, ``accuracy_vs_epsilon.png`` and
        ``time_per_point.png`` (and ``accuracy_vs_bytes.png`` for a sweep over compression
        settings) are (over)written there.

    Raises
    ------
    FedPSError
        If the results file is missing, unreadable or holds no records.
    """
    records = read_results(results_path)
    if not records:
        raise FedPSError(f"no results in {results_path}")
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_accuracy(records, out_dir / _ACCURACY_PNG)
    _plot_time(records, out_dir / _TIME_PNG)
    compressed = _varying([r for r in records if _succeeded(r)], "compression")
    if compressed:
        _plot_bytes(records, out_dir / _BYTES_PNG)
    first = records[0]
    failed = sum(1 for r in records if "error" in r)
    minutes = sum(_float(r.get("seconds")) or 0.0 for r in records) / 60
    lines = [
        "# Privacy-accuracy sweep",
        "",
        f"From `{results_path.name}`: {len(records)} points ({failed} failed), "
        f"{_task_words(first)}, {first.get('rounds', '?')} rounds, {minutes:.1f} min of runs "
        "in all.",
        "",
        "ε target ∞ means no DP (clipping only, noise multiplier 0: see "
        "docs/privacy-accuracy.md). ε spent is the largest epsilon any "
        "client reported, at δ; noise mult. is the noise multiplier (mean over clients when it is "
        "calibrated to the target). Time is the whole run of the point: processes starting, "
        "training, stopping.",
        "",
        _noise_line(records),
        "",
        *_table(records),
        *_encryption_pairs(records),
        *_over_seeds(records),
        "",
        f"![accuracy vs epsilon]({_ACCURACY_PNG})",
        "",
        f"![time per point]({_TIME_PNG})",
        "",
        *([f"![accuracy vs bytes]({_BYTES_PNG})", ""] if compressed else []),
    ]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report
