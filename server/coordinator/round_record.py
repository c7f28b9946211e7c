"""The records of a round: its outcome, the round in progress, and its clients' metrics.

:class:`RoundRecord` is what the coordinator's history keeps of every finished round (and what
its checkpoint and status report carry); :class:`OpenRound` is the round in progress, which a
checkpoint keeps so that a restarted coordinator continues it. With ``task.client_eval``
clients report the task's metrics on their own data: :func:`check_metrics` refuses a report
that is not a few finite, named numbers, and :func:`merged_metrics` takes each metric's median
over the round's contributors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedps.errors import InvalidArgumentError

__all__ = ["OpenRound", "RoundRecord", "check_metrics", "merged_metrics"]


@dataclass
class RoundRecord:
    """The outcome of one round."""

    round: int
    version: int
    contributors: int
    accuracy: float = -1.0
    loss: float = -1.0
    max_epsilon: float = 0.0
    #: the task's evaluation of the round's model: ``loss`` and its metrics (empty: none)
    metrics: dict[str, float] = field(default_factory=dict)
    bytes_pushed: int = 0
    seconds: float = 0.0
    abandoned: bool = False
    push_seconds: float = 0.0  # from the freeze of the commitments to the close
    #: client level: the noise multiplier the released model carries (0: example level)
    noise_multiplier: float = 0.0
    cohort: int = 0  # clients drawn for the round


@dataclass
class OpenRound:
    """The round in progress, as a checkpoint keeps it (a restarted coordinator continues it)."""

    round: int
    version: int
    deadline: float  # math.inf: none (the round policy says)
    cohort: frozenset[str]
    reported: set[str] = field(default_factory=set)
    closing: bool = False  # the shards may have closed it: do not wait for reports again
    pushing: bool = False  # the commitments are frozen and the shards take pushes
    committed: frozenset[str] = frozenset()  # so far (commit phase), then the frozen set
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # task.client_eval

    def to_json(self) -> dict[str, object]:
        """What a checkpoint keeps of the round."""
        return {
            "round": self.round,
            "version": self.version,
            "deadline": self.deadline,
            "cohort": sorted(self.cohort),
            "closing": self.closing,
            "pushing": self.pushing,
        }

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> OpenRound:
        """The round a checkpoint kept (:meth:`to_json`)."""
        return cls(
            int(o["round"]),
            int(o["version"]),
            float(o["deadline"]),
            frozenset(o["cohort"]),
            closing=bool(o["closing"]),
            pushing=bool(o.get("pushing", False)),
        )


#: Bounds on what a client may report of its own evaluation (task.client_eval).
_MAX_METRICS = 16
_MAX_METRIC_NAME = 64


def check_metrics(metrics: Mapping[str, float]) -> None:
    """Refuse reported metrics that are not a few finite, named numbers."""
    if len(metrics) > _MAX_METRICS:
        raise InvalidArgumentError(f"at most {_MAX_METRICS} metrics, got {len(metrics)}")
    for name, value in metrics.items():
        if not name or len(name) > _MAX_METRIC_NAME:
            raise InvalidArgumentError(f"a metric name has 1 to {_MAX_METRIC_NAME} characters")
        if not math.isfinite(value):
            raise InvalidArgumentError(f"metric {name!r} is not finite")


def merged_metrics(reports: list[dict[str, float]]) -> dict[str, float]:
    """Each metric over the clients that reported it: the median.

    Each client counts once, and one client's number cannot move it past the others'; an accuracy is
    kept within [0, 1].
    """
    names = sorted({name for report in reports for name in report})
    merged = {name: float(np.median([r[name] for r in reports if name in r])) for name in names}
    if "accuracy" in merged:
        merged["accuracy"] = min(1.0, max(0.0, merged["accuracy"]))
    return merged
