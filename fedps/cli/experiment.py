"""``fedps experiment``: a privacy-accuracy grid, one real platform run per point.

A grid file is a fedps configuration (``[training]``, ``[privacy]``, ``[he]``, ... as in
:mod:`fedps.config`, applied as overrides to the defaults) plus a ``[grid]`` table whose keys
are axes and whose values are lists::

    [training]
    rounds = 12

    [grid]
    epsilon = [1.0, 4.0, 8.0, "inf"]      # privacy.target_epsilon; "inf": no DP noise
    partition = ["iid", "dirichlet:0.5"]  # training.partition (+ dirichlet_alpha / shards)
    encryption = [true, false]            # he.enabled

A grid can train the user's own task: ``[task] app`` names it (:mod:`fedps.tasks`), its
project directory ``dir`` is relative to the grid file, and ``data`` gives each client its own
file, ``{index}`` standing for the client's number (``"data/client{index}.csv"``, relative to
the grid file too). A record then holds the task's metrics of the last evaluated round
(``final_metrics``, a ``final_NAME`` column each in the CSV) beside ``final_accuracy`` (for
classification).

The cartesian product of the axes gives the points. Each point runs the whole platform (key
holder, shards, coordinator and clients as processes on loopback, :func:`fedps.cli.demo.run_demo`)
and appends one JSON line to the results file, refreshing a CSV beside it. A sweep run again
with the same results file skips the points already recorded without an error, so an
interrupted sweep resumes where it stopped and failed points are retried.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import itertools
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from crypto.files import private_directory
from fedps.cli.demo import run_demo
from fedps.config import FedPSConfig, load_config, read_toml
from fedps.errors import ConfigError, FedPSError
from server.coordinator.checkpoint_store import CheckpointStore

__all__ = ["Grid", "Point", "load_grid", "read_results", "run_experiment"]

_log = logging.getLogger("fedps")

_SETUP_AXES = ("centralised", "partition", "clients", "mode", "dropout", "encryption")
"""The axes of the platform's set-up (then come the privacy axes and the seed)."""
_AXES = (*_SETUP_AXES, "epsilon", "noise_multiplier", "seed")
"""Every axis, in the order points are enumerated and keys are written."""

_SECTIONS = ("cluster", "task", "training", "privacy", "he", "security", "tls")
_NO_DP_NOISE = 0.0
"""The noise multiplier of "no DP" (epsilon ``"inf"``): clipping stays on, no noise is added,
and the clients report an infinite epsilon."""
_PARTITION = re.compile(r"^(iid|dirichlet|shard)(?::(.+))?$")
_CSV_COLUMNS = (
    "key",
    "task",
    "dataset",
    "model",
    "rounds",
    *_SETUP_AXES,
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


AxisValue = bool | int | float | str
"""The type of one axis value."""


def _format(value: object) -> str:
    """An axis value as written in keys and tables: ``1``, ``0.5``, ``inf``, ``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


def _parse_partition(value: str) -> dict[str, object]:
    """``"iid"``, ``"dirichlet:0.5"`` or ``"shard:2"`` as training overrides."""
    match = _PARTITION.match(value.strip())
    if match is None:
        raise ValueError(f"partition {value!r} is not iid, dirichlet[:ALPHA] or shard[:N]")
    kind, arg = match.groups()
    training: dict[str, object] = {"partition": kind}
    if arg is None:
        return training
    try:
        if kind == "dirichlet":
            alpha = float(arg)
            if not alpha > 0 or math.isinf(alpha):
                raise ValueError
            training["dirichlet_alpha"] = alpha
        elif kind == "shard":
            shards = int(arg)
            if shards < 1:
                raise ValueError
            training["shards_per_client"] = shards
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"partition {value!r}: bad argument {arg!r}") from None
    return training


def _partition_name(config: FedPSConfig) -> str:
    t = config.training
    if t.partition == "dirichlet":
        return f"dirichlet:{t.dirichlet_alpha:g}"
    if t.partition == "shard":
        return f"shard:{t.shards_per_client}"
    return t.partition


class _Axes(BaseModel):
    """The ``[grid]`` table: each axis a non-empty list of distinct values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    centralised: list[StrictBool] | None = Field(None, min_length=1)
    partition: list[str] | None = Field(None, min_length=1)
    clients: list[Annotated[StrictInt, Field(ge=1)]] | None = Field(None, min_length=1)
    mode: list[Literal["sync", "async"]] | None = Field(None, min_length=1)
    dropout: list[Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]] | None = Field(
        None, min_length=1
    )
    encryption: list[StrictBool] | None = Field(None, min_length=1)
    epsilon: list[float] | None = Field(None, min_length=1)
    noise_multiplier: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        None, min_length=1
    )
    seed: list[StrictInt] | None = Field(None, min_length=1)

    @field_validator("epsilon", mode="before")
    @classmethod
    def _epsilon(cls, values: object) -> object:
        if not isinstance(values, list):
            return values
        out: list[object] = []
        for v in values:
            if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
                v = math.inf
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f'{v!r} is neither a number nor "inf"')
            if math.isnan(v) or v <= 0:
                raise ValueError(f"{v!r} is not a positive epsilon")
            out.append(float(v))
        return out

    @field_validator("partition")
    @classmethod
    def _partition(cls, values: list[str] | None) -> list[str] | None:
        for v in values or []:
            _parse_partition(v)
        return values

    @model_validator(mode="after")
    def _check(self) -> _Axes:
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ValueError("give the epsilon axis or the noise_multiplier axis, not both")
        for name in _AXES:
            values = getattr(self, name)
            if values is not None and len({_format(v) for v in values}) != len(values):
                raise ValueError(f"axis {name} repeats a value")
        if not self.given:
            raise ValueError(f"give at least one axis ({', '.join(sorted(_AXES))})")
        return self

    @property
    def given(self) -> dict[str, list[Any]]:
        """The axes the file sets, in enumeration order."""
        return {n: getattr(self, n) for n in _AXES if getattr(self, n) is not None}


@dataclass(frozen=True)
class Point:
    """One point of the grid.

    Attributes
    ----------
    key
        Stable name made of the axis values (``partition=iid,encryption=true,epsilon=1``);
        the results file is keyed by it.
    axes
        The point's axis values (normalised: a centralised point has one client, IID).
    overrides
        Configuration overrides (per section) for :func:`fedps.cli.demo.run_demo`.
    """

    key: str
    axes: dict[str, AxisValue]
    overrides: dict[str, dict[str, object]]


class Grid(BaseModel):
    """A grid file: base configuration sections and the ``[grid]`` axes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    privacy: dict[str, Any] = Field(default_factory=dict)
    he: dict[str, Any] = Field(default_factory=dict)
    security: dict[str, Any] = Field(default_factory=dict)
    tls: dict[str, Any] = Field(default_factory=dict)
    centralised: dict[str, Any] = Field(
        default_factory=dict,
        description="[training] settings of the centralised baseline only (its own recipe)",
    )
    axes: _Axes = Field(alias="grid")

    @model_validator(mode="after")
    def _own_files_fix_the_data(self) -> Grid:
        fixed = [axis for axis in ("centralised", "partition") if axis in self.axes.given]
        if self.task.get("data") and fixed:
            raise ValueError(
                f"[task] data gives each client its own file, so the {' and '.join(fixed)} "
                "axes cannot change who holds what; drop them from [grid]"
            )
        return self

    @property
    def base(self) -> dict[str, dict[str, Any]]:
        """The configuration sections the file sets (overrides of fedps's defaults)."""
        sections = {s: dict(getattr(self, s)) for s in _SECTIONS if getattr(self, s)}
        sections.get("task", {}).pop("data", None)  # the grid's, not the configuration's
        return {s: values for s, values in sections.items() if values}

    def client_data(self, clients: int) -> list[Path]:
        """Each client's own data file (``[task] data`` with ``{index}`` filled in); empty
        when the grid gives none."""
        pattern = self.task.get("data")
        return [Path(str(pattern).format(index=i)) for i in range(clients)] if pattern else []

    @property
    def digest(self) -> str:
        """A short digest of the base configuration; points of one sweep share it."""
        text = json.dumps(self.base, sort_keys=True, default=str)
        if self.centralised:
            text += json.dumps(self.centralised, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def points(self) -> list[Point]:
        """The cartesian product of the axes, without duplicates, in a stable order.

        Raises
        ------
        ConfigError
            If a point's configuration is invalid (naming the point and the field).
        """
        base = load_config(None, **self.base)
        given = self.axes.given
        points: dict[str, Point] = {}
        for values in itertools.product(*given.values()):
            axes = dict(zip(given, values, strict=True))
            if axes.get("centralised"):
                axes.update({k: v for k, v in (("partition", "iid"), ("clients", 1)) if k in axes})
            key = ",".join(f"{name}={_format(value)}" for name, value in axes.items())
            if key not in points:
                overrides = _overrides(self.base, base, axes)
                if axes.get("centralised"):
                    overrides.setdefault("training", {}).update(self.centralised)
                try:
                    load_config(None, **overrides)
                except ConfigError as exc:
                    raise ConfigError(f"grid point {key}: {exc}") from None
                points[key] = Point(key, axes, overrides)
        return list(points.values())


def _overrides(
    sections: Mapping[str, Mapping[str, object]],
    base: FedPSConfig,
    axes: Mapping[str, AxisValue],
) -> dict[str, dict[str, object]]:
    """The base sections with a point's axis values applied."""
    out = {name: dict(values) for name, values in sections.items()}
    training, privacy = out.setdefault("training", {}), out.setdefault("privacy", {})
    clients = base.training.clients
    if "partition" in axes:
        training.update(_parse_partition(str(axes["partition"])))
    if "clients" in axes:
        clients = int(axes["clients"])
    if axes.get("centralised"):
        clients = 1
        training["partition"] = "iid"
    if clients != base.training.clients:
        training["clients"] = clients
        training["min_quorum"] = min(base.training.min_quorum, clients)
        if base.training.cohort_size > clients:
            training["cohort_size"] = 0
    for name in ("mode", "dropout", "seed"):
        if name in axes:
            training[name] = axes[name]
    if "encryption" in axes:
        out.setdefault("he", {})["enabled"] = axes["encryption"]
    if "epsilon" in axes:
        epsilon = float(axes["epsilon"])
        if math.isinf(epsilon):
            privacy.update(noise_multiplier=_NO_DP_NOISE, target_epsilon=None)
        else:
            privacy.update(noise_multiplier=None, target_epsilon=epsilon)
    if "noise_multiplier" in axes:
        noise = float(axes["noise_multiplier"])
        privacy.update(noise_multiplier=noise, target_epsilon=None)
    return {name: values for name, values in out.items() if values}


def load_grid(path: Path) -> Grid:
    """Read and validate a grid file (every point's configuration is checked too).

    Parameters
    ----------
    path
        The grid TOML file.

    Raises
    ------
    ConfigError
        If the file is missing, is not TOML, names an unknown axis or section, gives a bad
        value, or makes an invalid configuration at some point.
    """
    data = read_toml(path, "grid")
    task = data.get("task")
    if isinstance(task, dict):
        data["task"] = _resolve_task(task, path)
    axes = data.get("grid")
    if axes is None:
        raise ConfigError(f"{path}: no [grid] table")
    if isinstance(axes, dict):
        unknown = sorted(set(axes) - set(_AXES))
        if unknown:
            raise ConfigError(
                f"{path}: unknown grid axis {', '.join(unknown)}; "
                f"known axes: {', '.join(sorted(_AXES))}"
            )
    try:
        grid = Grid.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "grid file"
            problems.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None
    try:
        grid.points()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return grid


def _resolve_task(task: dict[str, Any], grid_path: Path) -> dict[str, Any]:
    """``[task]`` with ``dir`` and ``data`` relative to the grid file (as a configuration
    file's ``dir`` is to it), and ``data`` checked to name each client's file."""
    here = grid_path.parent.resolve()
    out = dict(task)
    if out.get("app"):
        out["dir"] = str(here / str(out.get("dir") or "."))
    data = out.get("data")
    if data is not None:
        if not isinstance(data, str) or "{index}" not in data:
            raise ConfigError(
                f"{grid_path}: task.data: a path with {{index}} for the client's number, such "
                f'as "data/client{{index}}.csv"'
            )
        try:
            data.format(index=0)
        except (KeyError, IndexError, ValueError):
            raise ConfigError(
                f"{grid_path}: task.data: {data!r} has a field other than {{index}}"
            ) from None
        out["data"] = os.path.join(here, data)
    return out


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
        return " ".join(_format(v) for v in value)
    if isinstance(value, bool):
        return _format(value)
    return "" if value is None else value


def _write_csv(records: list[dict[str, Any]], path: Path) -> None:
    """Write ``records`` as CSV (one row per point; lists space-separated; a ``final_NAME``
    column for each metric a task reported, after ``final_accuracy``)."""
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
    """The end of the first role's log that reports an error (logs of a temporary workdir
    are removed with it, so a failed point keeps this much in its record)."""
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
        "partition": _partition_name(config),
        "clients": t.clients,
        "mode": t.mode,
        "dropout": t.dropout,
        "encryption": config.he.enabled,
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
    data = grid.client_data(int(record["clients"]))
    extra: dict[str, Any] = {"client_data": data} if data else {}
    try:
        summary = run_demo(None, workdir, overrides, quiet=True, timeout_s=timeout_s, **extra)
    except FedPSError as exc:
        _log.info("point %s failed: %s", point.key, exc)
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        record["seconds"] = round(time.time() - started, 2)
        record["workdir"] = str(workdir)
        record["log_tail"] = _failure_log(workdir / "state" / "logs")
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
    """``overrides`` with a checkpoint cadence that divides the rounds, so the coordinator's
    checkpoint holds the last round's metrics before it says training finished."""
    out = {name: dict(values) for name, values in overrides.items()}
    t = load_config(None, **overrides).training
    if t.rounds % t.checkpoint_every:
        out.setdefault("training", {})["checkpoint_every"] = math.gcd(t.rounds, t.checkpoint_every)
    return out


def _round_metrics(state_dir: Path) -> list[dict[str, float]]:
    """The task's metrics of each round (empty: not evaluated) from the coordinator's
    checkpoint; none when it left no checkpoint."""
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
    """``workdir`` (kept, for the logs), or a temporary directory removed afterwards."""
    if workdir is not None:
        yield private_directory(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="fedps-experiment-") as tmp:
        yield Path(tmp)


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
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} points"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with _root(workdir) as root, Progress(*columns, console=console, transient=True) as progress:
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
