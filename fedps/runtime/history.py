"""A run's history: every finished round with its evaluation and privacy spend.

:func:`read_history` asks the coordinator (its status RPC, as the operator identity) and, when
no coordinator answers, reads its checkpoint in ``cluster.state_dir/coordinator``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from crypto.tls import OPERATOR_NAME
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, PeerUnavailableError
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.runtime.api_base import ConfigLike, as_config, enable_default_logging, use_identity
from server.coordinator.checkpoint_store import CheckpointStore

__all__ = ["History", "read_history"]

_STATUS_S = 5.0


@dataclass(frozen=True)
class History:
    """The rounds a run finished, oldest first.

    Attributes
    ----------
    rounds
        One :class:`~fedps.rpc.coordinator_messages.RoundSummary` per finished round: its
        contributors, ``metrics`` (the task's evaluation: ``loss``, ``accuracy``, ... ; empty
        when the round was not evaluated), ``max_epsilon`` over the clients after it, bytes
        pushed and seconds.
    finished
        Whether training is over.
    max_epsilon
        The largest privacy spend of any client (at ``delta``).
    delta
        The delta of the spend.
    """

    rounds: tuple[RoundSummary, ...]
    finished: bool
    max_epsilon: float
    delta: float

    def metric(self, name: str) -> list[tuple[int, float]]:
        """``(round, value)`` of metric ``name`` for every evaluated round.

        ``name`` is such as ``"accuracy"`` or ``"loss"``.
        """
        return [(r.round, _metrics(r)[name]) for r in self.rounds if name in _metrics(r)]

    @property
    def final_metrics(self) -> dict[str, float]:
        """The metrics of the last evaluated round (empty if none was evaluated)."""
        evaluated = [m for r in self.rounds if (m := _metrics(r))]
        return evaluated[-1] if evaluated else {}

    @classmethod
    def of(cls, status: ClusterStatus) -> History:
        """The history in a coordinator's status."""
        return cls(status.history, status.finished, status.max_epsilon, status.delta)


def _metrics(record: RoundSummary) -> dict[str, float]:
    """A round's metrics; a coordinator that sends none still sends accuracy and loss."""
    if record.metrics:
        return dict(record.metrics)
    if record.accuracy < 0:
        return {}
    return {"accuracy": record.accuracy, "loss": record.loss}


def read_history(config: ConfigLike) -> History:
    """The run's history, from the coordinator or, when none answers, its checkpoint.

    Parameters
    ----------
    config
        The cluster's configuration, or the path of its TOML file.

    Raises
    ------
    FedPSError
        No coordinator answers and there is no readable checkpoint.
    """
    enable_default_logging()
    cfg = as_config(config)
    use_identity(cfg, OPERATOR_NAME)
    coordinator = CoordinatorStub(cfg.cluster.coordinator)
    try:
        return History.of(coordinator.get_status(timeout_s=_STATUS_S))
    except PeerUnavailableError as exc:
        return _from_checkpoint(cfg, exc)
    finally:
        coordinator.close()


def _from_checkpoint(config: FedPSConfig, unreachable: FedPSError) -> History:
    directory = config.cluster.state_dir / "coordinator"
    checkpoint = CheckpointStore(directory).load() if directory.is_dir() else None
    if checkpoint is None:
        raise FedPSError(
            f"no coordinator answers at {config.cluster.coordinator} ({unreachable}) and there "
            f"is no checkpoint in {directory}"
        )
    rounds = tuple(_summary(r) for r in checkpoint.state.get("history", ()))
    return History(
        rounds=rounds,
        finished=int(checkpoint.state.get("round", 0)) >= config.training.rounds,
        max_epsilon=max((r.max_epsilon for r in rounds), default=0.0),
        delta=config.privacy.delta,
    )


def _summary(record: Mapping[str, Any]) -> RoundSummary:
    """A checkpointed round record as a summary (fields it lacks keep their defaults)."""
    names: Iterable[str] = (f.name for f in fields(RoundSummary))
    return RoundSummary(**{n: record[n] for n in names if n in record})
