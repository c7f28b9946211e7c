"""The records of a round: its outcome, the round in progress, its clients' metrics, its phases.

:class:`RoundRecord` is what the coordinator's history keeps of every finished round (and what
its checkpoint and status report carry); :class:`OpenRound` is the round in progress, which a
checkpoint keeps so that a restarted coordinator continues it. With ``task.client_eval``
clients report the task's metrics on their own data: :func:`check_metrics` refuses a report
that is not a few finite, named numbers, and :func:`merged_metrics` takes each metric's median
over the round's contributors. Every client reports the seconds of its phases of the round
(:mod:`fedps.round_timer`): :func:`check_phase_seconds` refuses what is not a few finite,
non-negative, named numbers, and :func:`critical_path` puts a round's phases together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedps.errors import InvalidArgumentError
from fedps.round_timer import BEFORE_BARRIER, CLIENT_PHASES, CRITICAL_PATH

__all__ = [
    "CLIENT_PHASE_ROUNDS",
    "MAX_CLIENT_PHASES",
    "OpenRound",
    "RoundRecord",
    "check_metrics",
    "check_phase_seconds",
    "critical_path",
    "known_phases",
    "merged_metrics",
    "slowest_clients",
]


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
    #: where the round's seconds went (:mod:`fedps.round_timer`): its critical path
    #: (:func:`critical_path`), the coordinator's and the key holder's own phases (the key
    #: holder's inside ``apply_call``), and the phases the slowest clients to commit reported
    #: (at most :data:`MAX_CLIENT_PHASES`; the history keeps them for the last
    #: :data:`CLIENT_PHASE_ROUNDS` rounds)
    phases: dict[str, float] = field(default_factory=dict)
    server_phases: dict[str, float] = field(default_factory=dict)
    client_phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def take_metrics(self, metrics: Mapping[str, float]) -> None:
        """Keep ``metrics`` of the round's model, with its accuracy and loss (-1: not among them).

        Parameters
        ----------
        metrics
            The task's metrics (``loss`` among them, where it has one).
        """
        self.metrics = dict(metrics)
        self.accuracy = metrics.get("accuracy", -1.0)
        self.loss = metrics.get("loss", -1.0)


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
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # reported, by client

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
#: Bounds on the phases a client (or the key holder) reports: how many, how long a name, the
#: most seconds one phase may take (a week).
_MAX_PHASES = 32
_MAX_PHASE_NAME = 32
_MAX_PHASE_S = 7 * 86400.0
#: The most clients whose own phases a round's record keeps (the slowest to commit), and for
#: how many of the last rounds the history keeps them.
MAX_CLIENT_PHASES = 16
CLIENT_PHASE_ROUNDS = 64


def _check_numbers(
    values: Mapping[str, float], what: str, *, most: int, name_length: int, high: float
) -> None:
    """Refuse ``values`` unless they are a few finite, named numbers.

    At most ``most``, each named by 1 to ``name_length`` characters, finite and at most
    ``high`` (and not negative when ``high`` is finite).
    """
    if len(values) > most:
        raise InvalidArgumentError(f"at most {most} {what}s, got {len(values)}")
    for name, value in values.items():
        if not name or len(name) > name_length:
            raise InvalidArgumentError(f"a {what} name has 1 to {name_length} characters")
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{what} {name!r} is not finite")
        if math.isfinite(high) and not 0.0 <= value <= high:
            raise InvalidArgumentError(f"{what} {name!r} is not within [0, {high:g}]")


def check_metrics(metrics: Mapping[str, float]) -> None:
    """Refuse reported metrics that are not a few finite, named numbers."""
    _check_numbers(
        metrics, "metric", most=_MAX_METRICS, name_length=_MAX_METRIC_NAME, high=math.inf
    )


def check_phase_seconds(phase_seconds: Mapping[str, float]) -> None:
    """Refuse reported phase seconds that are not a few finite, non-negative, named numbers.

    At most 32 phases, names of at most 32 characters, a week at most each.
    """
    _check_numbers(
        phase_seconds, "phase", most=_MAX_PHASES, name_length=_MAX_PHASE_NAME, high=_MAX_PHASE_S
    )


def known_phases(phase_seconds: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """The phases of ``phase_seconds`` that are among ``names``, in that order.

    A newer peer's other phases are left out: only known names reach the records and the
    metrics.
    """
    return {name: float(phase_seconds[name]) for name in names if name in phase_seconds}


def _before_barrier(phases: Mapping[str, float]) -> float:
    return math.fsum(phases.get(name, 0.0) for name in BEFORE_BARRIER)


def slowest_clients(
    reported: Mapping[str, Mapping[str, float]], most: int = MAX_CLIENT_PHASES
) -> dict[str, dict[str, float]]:
    """The phases of the ``most`` clients that took longest up to the barrier, by client id.

    They are the last to commit.
    """
    ranked = sorted(reported, key=lambda c: (-_before_barrier(reported[c]), c))[:most]
    return {c: dict(reported[c]) for c in sorted(ranked)}


def critical_path(
    seconds: float,
    server: Mapping[str, float],
    clients: Mapping[str, Mapping[str, float]],
) -> dict[str, float]:
    """A round's critical path (:data:`fedps.round_timer.CRITICAL_PATH`).

    The coordinator's opening, every phase of the client that took longest up to the barrier
    (its barrier, its push), then the servers' phases after the pushes (``server``: the
    coordinator's and the key holder's), and ``other``: what is left of the round's
    ``seconds``.

    The parts are intervals that do not overlap (the client's run between the opening and
    the close, the key holder's inside the coordinator's ``apply_call``), so they add up to
    at most ``seconds``; ``other`` is the calls in flight, the polling and the checkpoints.
    """
    slowest: Mapping[str, float] = {}
    if clients:
        slowest = clients[max(clients, key=lambda c: (_before_barrier(clients[c]), c))]
    parts = {**known_phases(slowest, CLIENT_PHASES), **server}
    path = {name: float(parts[name]) for name in CRITICAL_PATH if name in parts}
    path["other"] = max(0.0, seconds - math.fsum(path.values()))
    return path


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
