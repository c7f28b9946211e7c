"""A privacy-accuracy grid file: base configuration sections and the ``[grid]`` axes.

A grid file is a fedps configuration (``[training]``, ``[privacy]``, ``[he]``, ... as in
:mod:`fedps.config`, applied as overrides to the defaults) plus a ``[grid]`` table whose keys
are axes and whose values are lists::

    [training]
    rounds = 12

    [grid]
    epsilon = [1.0, 4.0, 8.0, "inf"]      # privacy.target_epsilon; "inf": no DP noise
    partition = ["iid", "dirichlet:0.5"]  # training.partition (+ dirichlet_alpha / shards)
    encryption = [true, false]            # he.enabled
    compression = ["1", "0.1+ef+8bit"]    # [compression] (docs/compression.md)

A grid can train the user's own task: ``[task] app`` names it (:mod:`fedps.learning.tasks`), its
project directory ``dir`` is relative to the grid file, and ``data`` gives each client its own
file, ``{index}`` standing for the client's number (``"data/client{index}.csv"``, relative to
the grid file too). The cartesian product of the axes gives the points
(:meth:`Grid.points`); :mod:`fedps.experiments.experiment` runs them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
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

from fedps.config import CompressionConfig, FedPSConfig, load_config, read_toml
from fedps.errors import ConfigError
from fedps.runtime.preflight import check_names

__all__ = [
    "AXES",
    "SETUP_AXES",
    "AxisValue",
    "Grid",
    "Point",
    "format_value",
    "load_grid",
    "partition_name",
]

SETUP_AXES = (
    "centralised",
    "partition",
    "clients",
    "mode",
    "dropout",
    "encryption",
    "compression",
)
"""The axes of the platform's set-up (then come the privacy axes and the seed)."""
AXES = (*SETUP_AXES, "epsilon", "noise_multiplier", "seed")
"""Every axis, in the order points are enumerated and keys are written."""

_SECTIONS = ("cluster", "task", "training", "privacy", "he", "compression", "security", "tls")
_NO_DP_NOISE = 0.0
"""The noise multiplier of "no DP" (epsilon ``"inf"``): clipping stays on, no noise is added,
and the clients report an infinite epsilon."""
_PARTITION = re.compile(r"^(iid|dirichlet|shard)(?::(.+))?$")
AxisValue = bool | int | float | str
"""The type of one axis value."""


def format_value(value: object) -> str:
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


def partition_name(config: FedPSConfig) -> str:
    """``config``'s partition as a grid writes it: ``"dirichlet:0.5"``, ``"shard:2"``, ``"iid"``."""
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
    compression: list[str] | None = Field(None, min_length=1)
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

    @field_validator("compression")
    @classmethod
    def _compression(cls, values: list[str] | None) -> list[str] | None:
        """Each setting spelt as ``fedps bench --compression`` spells it, written canonically."""
        if values is None:
            return None
        return [CompressionConfig.from_setting(v).setting for v in values]

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
        for name in AXES:
            values = getattr(self, name)
            if values is not None and len({format_value(v) for v in values}) != len(values):
                raise ValueError(f"axis {name} repeats a value")
        if not self.given:
            raise ValueError(f"give at least one axis ({', '.join(sorted(AXES))})")
        return self

    @property
    def given(self) -> dict[str, list[Any]]:
        """The axes the file sets, in enumeration order."""
        return {n: getattr(self, n) for n in AXES if getattr(self, n) is not None}


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
        Configuration overrides (per section) for :func:`fedps.runtime.demo.run_demo`.
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
    compression: dict[str, Any] = Field(default_factory=dict)
    security: dict[str, Any] = Field(default_factory=dict)
    tls: dict[str, Any] = Field(default_factory=dict)
    centralised: dict[str, Any] = Field(
        default_factory=dict,
        description="[training] settings of the centralised baseline only (its own recipe)",
    )
    axes: _Axes = Field(alias="grid")

    @model_validator(mode="after")
    def _own_files_fix_the_data(self) -> Grid:
        if self.task.get("data") and "partition" in self.axes.given:
            raise ValueError(
                "[task] data gives each client its own file, so the partition axis cannot "
                "change who holds what; drop it from [grid]"
            )
        return self

    @property
    def base(self) -> dict[str, dict[str, Any]]:
        """The configuration sections the file sets (overrides of fedps's defaults)."""
        sections = {s: dict(getattr(self, s)) for s in _SECTIONS if getattr(self, s)}
        sections.get("task", {}).pop("data", None)  # the grid's, not the configuration's
        return {s: values for s, values in sections.items() if values}

    def client_data(self, clients: int) -> list[Path]:
        """Each client's own data file (``[task] data`` with ``{index}`` filled in).

        Empty when the grid gives none.
        """
        pattern = self.task.get("data")
        return [Path(str(pattern).format(index=i)) for i in range(clients)] if pattern else []

    def point_data(self, point: Point) -> list[Path | list[Path]]:
        """The data of each client of ``point``: a file each, empty when the grid gives none.

        A centralised point's one client pools the files of every client of the federated
        points (``training.clients``, or the largest of the ``clients`` axis).
        """
        if point.axes.get("centralised"):
            clients = self.axes.clients or [load_config(None, **self.base).training.clients]
            files = self.client_data(max(clients))
            return [files] if files else []
        return list(self.client_data(load_config(None, **point.overrides).training.clients))

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
            key = ",".join(f"{name}={format_value(value)}" for name, value in axes.items())
            if key not in points:
                overrides = _overrides(self.base, base, axes)
                if axes.get("centralised"):
                    overrides.setdefault("training", {}).update(self.centralised)
                try:
                    check_names(load_config(None, **overrides))
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
    if "compression" in axes:
        setting = CompressionConfig.from_setting(str(axes["compression"]))
        out["compression"] = {**out.get("compression", {}), **setting.model_dump()}
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
        unknown = sorted(set(axes) - set(AXES))
        if unknown:
            raise ConfigError(
                f"{path}: unknown grid axis {', '.join(unknown)}; "
                f"known axes: {', '.join(sorted(AXES))}"
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
    """``[task]`` with ``dir`` and ``data`` relative to the grid file, and ``data`` checked.

    They are relative to it as a configuration file's ``dir`` is to it; ``data`` is checked to name
    each client's file.
    """
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
