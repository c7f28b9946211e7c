"""A round's published model evaluated on a thread of its own, off the rounds' critical path.

The coordinator's own round loop (:meth:`.Coordinator.run`) starts the next round as soon as a
round is applied, and pulls and evaluates its published model meanwhile: the evaluation then
overlaps the next round's opening, its clients' pulls and their training instead of delaying
them. The round's record waits for its metrics and enters the history once it has them, so
every round's accuracy is recorded exactly once and in round order: the loop waits for one
evaluation (:meth:`BackgroundEvaluation.wait`) before it records the next round, before every
checkpoint that can follow an applied round, and before the run ends or stops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from server.coordinator.round_record import RoundRecord

__all__ = ["BackgroundEvaluation"]


class BackgroundEvaluation:
    """Evaluates one round's published model on a thread of its own, then records the round.

    Parameters
    ----------
    record
        The round's record, complete but for its metrics.
    evaluate
        Pulls the round's published model and evaluates it: the model and its metrics.
    done
        Records the round once its metrics are in ``record`` (on the evaluation's thread).
    """

    def __init__(
        self,
        record: RoundRecord,
        evaluate: Callable[[], tuple[np.ndarray, dict[str, float]]],
        done: Callable[[RoundRecord], None],
    ) -> None:
        self.record = record
        self._evaluate = evaluate
        self._done = done
        self._vector: np.ndarray | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"evaluate round {record.round}", daemon=True
        )

    def start(self) -> None:
        """Start evaluating."""
        self._thread.start()

    def _run(self) -> None:
        try:
            vector, metrics = self._evaluate()
        except BaseException as exc:  # raised in the round loop by wait()
            self._error = exc
            return
        self.record.take_metrics(metrics)
        self._vector = vector
        self._done(self.record)

    def wait(self) -> np.ndarray:
        """Wait until the round is evaluated and recorded; the model it evaluated.

        Raises
        ------
        BaseException
            What the evaluation raised (the round is not recorded), for instance
            :class:`~fedps.errors.FedPSError` when a stop ended its pull.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._vector is not None
        return self._vector
