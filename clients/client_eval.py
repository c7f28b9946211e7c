"""``task.client_eval``: each round's starting model evaluated on the client's own data.

For a task without the operator's evaluation data (``load_eval_data``), the clients'
metrics are the only ones the coordinator gets: each client evaluates the model of the round
it trains for on its own data, and reports the metrics with the round. They leave the client
outside the DP guarantee, which the client says once, when it starts.
"""

from __future__ import annotations

import logging

import numpy as np

from fedps.config import FedPSConfig
from fedps.learning.datasets import Dataset
from fedps.learning.tasks import Task, evaluate_model
from fedps.sharding.blocks import load_flat

__all__ = ["ClientEvaluation"]

_log = logging.getLogger("fedps")


class ClientEvaluation:
    """The task's metrics of each round's starting model on a client's own data.

    Kept until the round is reported.

    Parameters
    ----------
    task
        The task (its model, loss and metrics).
    data
        The client's own data.
    seed
        The seed the task's model is created with (``training.seed``).
    name
        The client's display name (for the log).
    """

    def __init__(self, task: Task, data: Dataset, *, seed: int, name: str) -> None:
        self.task = task
        self.data = data
        self.seed = seed
        self._metrics: dict[int, dict[str, float]] = {}  # by round, until reported
        _log.warning(
            "%s: task.client_eval: the task's metrics on this client's own data go to the "
            "coordinator every round, outside the DP guarantee",
            name,
        )

    @classmethod
    def configured(
        cls, config: FedPSConfig, task: Task, data: Dataset | None, *, name: str
    ) -> ClientEvaluation | None:
        """The client's evaluation under ``task.client_eval`` (None: it evaluates nothing).

        Only for a task without the operator's evaluation data (else none would be used), and a
        client with data of its own.
        """
        if not config.task.client_eval or task.load_eval_data is not None or data is None:
            return None
        return cls(task, data, seed=config.training.seed, name=name)

    def evaluate(self, round_: int, vector: np.ndarray) -> dict[str, float]:
        """The metrics of the model ``vector`` (flat parameters) that round ``round_`` starts from.

        Kept for :meth:`take` (in place of an earlier round's).
        """
        model = self.task.create_model(self.seed)
        load_flat(model, vector)
        metrics = evaluate_model(self.task, model, self.data)
        self._metrics = {round_: metrics}
        return metrics

    def take(self, round_: int) -> dict[str, float]:
        """Round ``round_``'s metrics, once (empty: none kept for it)."""
        return self._metrics.pop(round_, {})
