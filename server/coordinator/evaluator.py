"""Evaluates a published model on the operator's held-out data (the task's evaluation set).

Without such data nothing is evaluated here: with ``task.client_eval`` the clients report the
metrics of each round's starting model on their own data instead (outside the DP guarantee).
"""

from __future__ import annotations

import logging

import numpy as np

from fedps.learning.tasks import Task, evaluate_model
from fedps.sharding.blocks import flatten_model, load_flat

__all__ = ["Evaluator"]

_log = logging.getLogger("fedps")


class Evaluator:
    """The task's metrics of a flat parameter vector on the task's evaluation data.

    Parameters
    ----------
    task
        The task: its model (built with ``seed``) gives the initial parameters, its
        ``load_eval_data`` the held-out data (none: :meth:`evaluate` returns nothing).
    seed
        The seed of the model's initial weights (every party builds the same model from it).
    client_eval
        Whether the clients evaluate instead when there is no held-out data
        (``task.client_eval``).
    """

    def __init__(self, task: Task, *, seed: int, client_eval: bool = False) -> None:
        self.task = task
        self.model = task.create_model(seed)
        self._data = task.eval_data()
        #: whether clients report metrics on their own data (asked for, and no data here)
        self.client_eval = client_eval and self._data is None
        if self._data is not None:
            task.check_fit(self.model, self._data)
        else:
            _log.info(
                "task %r has no evaluation data (load_eval_data): %s",
                task.name,
                "its clients report the metrics of each round's starting model on their own "
                "data (task.client_eval)"
                if self.client_eval
                else "rounds are not evaluated (task.client_eval = true has clients report "
                "metrics on their own data, outside the DP guarantee)",
            )

    @property
    def has_data(self) -> bool:
        """Whether the operator holds evaluation data."""
        return self._data is not None

    def initial_vector(self) -> np.ndarray:
        """The model's deterministic initial parameters."""
        return flatten_model(self.model)

    def evaluate(self, vector: np.ndarray) -> dict[str, float]:
        """``loss`` and the task's metrics of ``vector`` (empty without evaluation data)."""
        if self._data is None:
            return {}
        load_flat(self.model, vector)
        return evaluate_model(self.task, self.model, self._data)
