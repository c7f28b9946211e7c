"""``fedps experiment``: a privacy-accuracy grid, one real platform run per point.

A grid file (:mod:`fedps.experiments.grid`, whose docstring shows one) is a fedps
configuration plus a ``[grid]`` table of axes, each a list of values; it may train the user's
own task, each client on its own file. A record of such a task holds the task's metrics of the
last evaluated round (``final_metrics``, a ``final_NAME`` column each in the CSV) beside
``final_accuracy`` (for classification).

The cartesian product of the axes gives the points. Each point runs the whole platform (key
holder, shards, coordinator and clients as processes on loopback,
:func:`fedps.runtime.demo.run_demo`)
and appends one JSON line to the results file, refreshing a CSV beside it. A sweep run again
with the same results file skips the points already recorded without an error, so an
interrupted sweep resumes where it stopped and failed points are retried.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from crypto.files import private_directory
from fedps.config import load_config
from fedps.errors import ConfigError, FedPSError
from fedps.experiments.grid import (
    SETUP_AXES,
    Grid,
    Point,
    format_value,
    load_grid,
    partition_name,
)
from fedps.runtime.demo import DEMO_LOGS, run_demo
from fedps.runtime.sweeper import temporary_folder
from server.coordinator.checkpoint_store import CheckpointStore

__all__ = ["read_results", "run_experiment"]

_log = logging.getLogger("fedps")

_CSV_COLUMNS = (
    "key",
    "task",
    "dataset",
    "model",
    "rounds",
    *SETUP_AXES,
    "seed",
    "epsilon",
    "noise_multiplier",
    "noise",
    "final_accuracy",
    "max_epsilon",
    "delta",
    "client_epsilons",
    "client_noise_multipliers",
    "seconds",
    "bytes_pushed",
    "abandoned_rounds",
    "finished_at",
    "error",
)


def read_results(path: Path) -> list[dict[str, Any]]:
    """The latest record of every point in a results file, in a canonical order.

    A later line for the same key supersedes an earlier one (a retried failure). Lines that
    are not JSON objects with a ``key`` (a write cut short) are skipped with a warning.

    Raises
    ------
    FedPSError
        If the file cannot be read.
    """
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise FedPSError(f"results file not found: {path}") from None
    except OSError as exc:
        raise FedPSError(f"cannot read results file {path}: {exc.strerror}") from None
    latest: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("key"), str):
            _log.warning("%s:%d: not a result record; skipped", path, number)
            continue
        latest[record["key"]] = record
    return sorted(latest.values(), key=_order)


def _number(value: object) -> float:
    """A record's numeric field (``"inf"`` and ``None`` sort last)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.inf


def _order(record: Mapping[str, Any]) -> tuple[object, ...]:
    """Centralised baseline first, then partition, encryption on before off, epsilon up."""
    return (
        not record.get("centralised", False),
        str(record.get("partition", "")),
        not record.get("encryption", True),
        _number(record.get("epsilon")),
        _number(record.get("noise_multiplier")),
        _number(record.get("clients")),
        str(record.get("mode", "")),
        _number(record.get("dropout")),
        _number(record.get("seed")),
        record["key"],
    )


def _csv_value(value: object) -> object:
    if isinstance(value, list):
        return " ".join(format_value(v) for v in value)
    if isinstance(value, bool):
        return format_value(value)
    return "" if value is None else value


def _write_csv(records: list[dict[str, Any]], path: Path) -> None:
    """Write ``records`` as CSV, one row per point.

    Lists are space-separated; a ``final_NAME`` column for each metric a task reported follows
    ``final_accuracy``.
    """
    names = sorted({n for r in records for n in r.get("final_metrics") or {}} - {"accuracy"})
    at = _CSV_COLUMNS.index("final_accuracy") + 1
    columns = (*_CSV_COLUMNS[:at], *(f"final_{n}" for n in names), *_CSV_COLUMNS[at:])
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        for record in records:
            metrics = record.get("final_metrics") or {}
            values = {**record, **{f"final_{n}": metrics.get(n) for n in names}}
            writer.writerow([_csv_value(values.get(c)) for c in columns])


def _append(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line, first ending a line an interrupted write left open."""
    with path.open("a+b") as out:
        out.seek(0, 2)
        if out.tell():
            out.seek(-1, 2)
            if out.read(1) != b"\n":
                out.write(b"\n")
        out.write(json.dumps(record).encode() + b"\n")


def _json_float(value: object, digits: int) -> float | str | None:
    """A float for JSON: rounded, infinity as ``"inf"`` (JSON has no infinity)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        return None
    if math.isinf(value):
        return "inf"
    return round(float(value), digits)


def _failure_log(log_dir: Path, chars: int = 1500) -> str | None:
    """The end of the first role's log that reports an error.

    Logs of a temporary workdir are removed with it, so a failed point keeps this much in its
    record.
    """
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text or "fedps: error:" in text or " ERROR " in text:
            return f"{log.name}: ...{text[-chars:]}"
    return None


def _describe(point: Point, grid: Grid) -> dict[str, Any]:
    """The effective settings of a point, as record fields."""
    config = load_config(None, **point.overrides)
    t, p = config.training, config.privacy
    epsilon: float | None = p.target_epsilon
    if point.axes.get("epsilon") == math.inf or point.axes.get("noise_multiplier") == 0:
        epsilon = math.inf  # no noise
    return {
        "key": point.key,
        "task": config.task.app or t.dataset,
        "dataset": t.dataset,
        "model": t.model,
        "rounds": t.rounds,
        "centralised": bool(point.axes.get("centralised", False)),
        "partition": partition_name(config),
        "clients": t.clients,
        "mode": t.mode,
        "dropout": t.dropout,
        "encryption": config.he.enabled,
        "compression": config.compression.setting,
        "seed": t.seed,
        "epsilon": _json_float(epsilon, 6),
        "noise_multiplier": p.noise_multiplier,
        "noise": p.noise_mode,
        "config_digest": grid.digest,
    }


def _run_point(point: Point, grid: Grid, root: Path, timeout_s: float) -> dict[str, Any]:
    """Run one point on the real platform; return its record (with ``error`` on failure)."""
    record = _describe(point, grid)
    slug = re.sub(r"[^A-Za-z0-9.=-]+", "_", point.key)[:80]
    workdir = Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=root))
    started = time.time()
    overrides = _checkpoint_last_round(point.overrides)
    data = grid.point_data(point)
    extra: dict[str, Any] = {"client_data": data} if data else {}
    try:
        summary = run_demo(None, workdir, overrides, quiet=True, timeout_s=timeout_s, **extra)
    except FedPSError as exc:
        _log.info("point %s failed: %s", point.key, exc)
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        record["seconds"] = round(time.time() - started, 2)
        record["workdir"] = str(workdir)
        record["log_tail"] = _failure_log(workdir / DEMO_LOGS)
    else:
        # as each client last reported them to the coordinator (the demo's summary); the
        # noise multipliers only when every client reported one
        epsilons = summary.client_epsilons
        noise = summary.client_noise_multipliers
        if len(noise) != int(record["clients"]):
            noise = ()
        if record["noise_multiplier"] is None and noise:
            record["noise_multiplier"] = round(sum(noise) / len(noise), 4)
        record.update(
            final_accuracy=_json_float(summary.final_accuracy, 6),
            max_epsilon=_json_float(summary.max_epsilon, 4),
            delta=summary.delta,
            client_epsilons=[_json_float(e, 4) for e in epsilons] if epsilons else None,
            client_noise_multipliers=[_json_float(s, 4) for s in noise] if noise else None,
            seconds=summary.seconds,
            bytes_pushed=summary.bytes_pushed,
            abandoned_rounds=summary.abandoned_rounds,
            round_accuracy=[_json_float(accuracy, 6) for _, accuracy in summary.round_accuracy],
        )
        round_metrics = _round_metrics(workdir / "state" / "coordinator")
        evaluated = [m for m in round_metrics if m]
        record.update(final_metrics=evaluated[-1] if evaluated else None)
        record.update(round_metrics=round_metrics)
    record["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    return record


def _checkpoint_last_round(
    overrides: Mapping[str, Mapping[str, object]],
) -> dict[str, dict[str, object]]:
    """``overrides`` with a checkpoint cadence that divides the rounds.

    So the coordinator's checkpoint holds the last round's metrics before it says training finished.
    """
    out = {name: dict(values) for name, values in overrides.items()}
    t = load_config(None, **overrides).training
    if t.rounds % t.checkpoint_every:
        out.setdefault("training", {})["checkpoint_every"] = math.gcd(t.rounds, t.checkpoint_every)
    return out


def _round_metrics(state_dir: Path) -> list[dict[str, float]]:
    """The task's metrics of each round (empty: not evaluated) from the coordinator's checkpoint.

    None when it left no checkpoint.
    """
    try:
        checkpoint = CheckpointStore(state_dir).load()
    except FedPSError as exc:
        _log.warning("no metrics: %s", exc)
        return []
    if checkpoint is None:
        return []
    return [
        {str(k): float(v) for k, v in dict(r.get("metrics") or {}).items()}
        for r in checkpoint.state.get("history", [])
    ]


@contextlib.contextmanager
def _root(workdir: Path | None) -> Iterator[Path]:
    """``workdir`` (kept, for the logs), or a temporary folder removed afterwards (SIGKILL too)."""
    if workdir is not None:
        yield private_directory(workdir)
        return
    with temporary_folder("fedps-experiment-") as tmp:
        yield tmp


def _summary_line(record: Mapping[str, Any]) -> str:
    if "error" in record:
        first = escape(str(record["error"]).partition("\n")[0])
        return f"{record['key']}: [red]FAILED[/] {first}"
    accuracy, epsilon = record.get("final_accuracy"), record.get("max_epsilon")
    acc = f"acc {accuracy:.4f}" if isinstance(accuracy, float) else "acc -"
    metrics = record.get("final_metrics") or {}
    if not isinstance(accuracy, float) and metrics:
        acc = "  ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items()))
    eps = str(epsilon)
    if isinstance(epsilon, float):
        eps = f"{epsilon:.3g}" if epsilon >= 1e4 else f"{epsilon:.2f}"
    return (
        f"{record['key']}: {acc}  eps {eps}  {record.get('seconds') or 0:.1f}s  "
        f"{(record.get('bytes_pushed') or 0) / 1e6:.2f} MB"
    )


#: The bar's width: with its counter and times it fits an 80-column terminal.
_BAR_WIDTH = 40


class _SweepProgress(Progress):
    """A progress bar with the running point's label on a line of its own above it.

    A label can be longer than a terminal is wide; in the bar's row it pushed the bar off the
    line. On its own line, one longer than the terminal ends in an ellipsis.
    """

    def get_renderables(self) -> Iterable[RenderableType]:
        """The label of each task, then the bars' table.

        Yields
        ------
        RenderableType
            What the live display shows, line by line.
        """
        for task in self.tasks:
            yield Text(
                task.description, style="progress.description", no_wrap=True, overflow="ellipsis"
            )
        yield self.make_tasks_table(self.tasks)


def run_experiment(
    grid_path: Path,
    results_path: Path,
    *,
    workdir: Path | None = None,
    console: Console | None = None,
    point_timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """Run every point of a grid not yet in the results file; return every point's record.

    Parameters
    ----------
    grid_path
        The grid file (see :func:`load_grid`).
    results_path
        JSON lines, one per finished point, appended to; ``results_path.with_suffix(".csv")``
        is rewritten after each point. Points recorded without an error are skipped.
    workdir
        Where each point's processes keep their state and logs (kept); default: a temporary
        directory, removed at the end.
    console
        Where progress goes (default: stdout).
    point_timeout_s
        A point that has not finished training after this long fails.

    Returns
    -------
    list of dict
        The latest record of every point of the grid, in the grid's order.

    Raises
    ------
    ConfigError
        If the grid is invalid, or the results file holds points of another base
        configuration.
    """
    console = console or Console()
    grid = load_grid(grid_path)
    points = grid.points()
    latest = {r["key"]: r for r in read_results(results_path)} if results_path.exists() else {}
    done = {k for k, r in latest.items() if "error" not in r}
    for key in done & {p.key for p in points}:
        if latest[key].get("config_digest") != grid.digest:
            raise ConfigError(
                f"{results_path} holds point {key} of another base configuration than "
                f"{grid_path}; give a new --results file"
            )
    pending = [p for p in points if p.key not in done]
    console.print(
        f"fedps experiment: {len(points)} points, {len(points) - len(pending)} already in "
        f"{results_path}, {len(pending)} to run"
    )
    results_path.parent.mkdir(parents=True, exist_ok=True)
    columns = (
        BarColumn(bar_width=_BAR_WIDTH),
        TextColumn("{task.completed}/{task.total} points"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with (
        _root(workdir) as root,
        _SweepProgress(*columns, console=console, transient=True) as progress,
    ):
        task = progress.add_task("sweep", total=len(pending))
        for point in pending:
            progress.update(task, description=point.key)
            record = _run_point(point, grid, root, point_timeout_s)
            _append(results_path, record)
            latest[point.key] = record
            _write_csv(read_results(results_path), results_path.with_suffix(".csv"))
            progress.console.print(_summary_line(record))
            progress.advance(task)
    if not pending and results_path.exists():
        _write_csv(read_results(results_path), results_path.with_suffix(".csv"))
    return [latest[p.key] for p in points]
