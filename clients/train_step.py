"""One round's local training as a mod sees it, and the mods that wrap it.

A client is extended from outside the way Flower extends its clients with mods
(``secaggplus_mod(msg, ctx, call_next)``): a :data:`TrainMod` receives the round
(:class:`TrainStep`), the model it starts from and ``call_next``, the rest of the chain down
to the trainer. It may act before and after training, or return ``None`` for "no update
this round" (the client then pushes nothing; the privacy the round spent is recorded all the
same). :class:`clients.simulation.SimulatedDevice` (slow devices, dropouts) is one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TrainFn", "TrainMod", "TrainStep", "chain"]


@dataclass(frozen=True)
class TrainStep:
    """One round's local training.

    Attributes
    ----------
    name
        The client's display name (for logs).
    client_id
        The id the coordinator gave the client.
    round
        The round trained for.
    version
        The model version trained on.
    deadline_unix
        When the round closes (Unix time; 0: not known).
    weight
        The aggregation weight the update will carry.
    """

    name: str
    client_id: str
    round: int
    version: int
    deadline_unix: float
    weight: float


#: A training step: the model's flat parameters in, the update out (None: no update).
TrainFn = Callable[[TrainStep, np.ndarray], np.ndarray | None]

#: A mod: ``mod(step, params, call_next)`` calls ``call_next(step, params)`` (or not) and
#: returns the update, or None for no update this round.
TrainMod = Callable[[TrainStep, np.ndarray, TrainFn], np.ndarray | None]


def chain(mods: Sequence[TrainMod], train: TrainFn) -> TrainFn:
    """``train`` wrapped in ``mods``, the first outermost (it sees what the others return)."""
    step_fn = train
    for mod in reversed(mods):
        step_fn = _wrap(mod, step_fn)
    return step_fn


def _wrap(mod: TrainMod, call_next: TrainFn) -> TrainFn:
    def wrapped(step: TrainStep, params: np.ndarray) -> np.ndarray | None:
        return mod(step, params, call_next)

    return wrapped
