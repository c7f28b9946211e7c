"""Evaluates a published model on the operator's held-out data (the task's evaluation set)."""

from __future__ import annotations

import numpy as np

from fedps.blocks import flatten_model, load_flat
from fedps.tasks import Task, evaluate_model

__all__ = ["Evaluator"]


class Evaluator:
    """The task's metrics of a flat parameter vector on the task's evaluation data.

    Parameters
    ----------
    task
        The task: its model (built with ``seed``) gives the initial parameters, its
        ``load_eval_data`` the held-out data (none: :meth:`evaluate` returns nothing).
    """

    def __init__(self, task: Task, *, seed: int) -> None:
        self.task = task
        self.model = task.create_model(seed)
        self._data = task.eval_data()
        if self._data is not None:
            task.check_fit(self.model, self._data)

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
