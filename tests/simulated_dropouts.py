"""Simulated dropouts whose rounds end once the rest of the cohort has committed.

A client of the simulation that dies mid-round (:class:`clients.simulation.SimulatedDevice`,
``training.dropout``) stays away until the round's deadline, and the round's commit phase
waits for it until then. A test with a short deadline sits through it in every round with a
dropout, and on a loaded machine its healthy clients can miss it too; with a deadline long
enough for them, it sits through much more. :class:`SimulatedDropouts` keeps the deadline a
hang guard and ends each commit phase as its deadline does (the deadline becomes now, the
coordinator's own path) as soon as every member of the cohort has committed or died.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from clients.simulation import SimulatedDevice
from clients.train_step import TrainFn, TrainMod, TrainStep
from server.coordinator.round_record import OpenRound
from tests.in_process_cluster import Cluster, commit_phase_over, end_commit_phase_if
from tests.waiting import wait_for

__all__ = ["SimulatedDropouts"]


class SimulatedDropouts:
    """The simulated devices of ``cluster``'s clients, their dead ending rounds at once.

    Each client's :class:`~clients.simulation.SimulatedDevice` (built from the cluster's
    ``training`` section: its ``dropout`` draws, slow devices) is wrapped by a mod that
    watches it. A client whose device dies in round r is told that the round closes now (its
    device does not sleep until the deadline); the mod then keeps it away until round r's
    commit phase is over, as the device would, and ends that phase as soon as every cohort
    member has committed, said it has nothing to send, or died. A healthy client is thus
    never left out by a loaded machine: its round waits for it up to ``deadline_s``.

    Parameters
    ----------
    cluster
        The cluster; its coordinator may start after the clients are built.
    """

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._lock = threading.Lock()
        self._dead: dict[int, set[str]] = {}  # by round: the clients whose device died in it

    def mods(self, index: int) -> list[TrainMod]:
        """The mods of client ``index``: its watched simulated device."""
        return [self._watch, SimulatedDevice(self._cluster.config.training, index=index)]

    def _watch(self, step: TrainStep, params: np.ndarray, call_next: TrainFn) -> np.ndarray | None:
        """Run the device (``call_next``) with a deadline of now; a death ends the round early."""
        delta = call_next(dataclasses.replace(step, deadline_unix=time.time()), params)
        if delta is None:
            with self._lock:
                self._dead.setdefault(step.round, set()).add(step.client_id)
            wait_for(lambda: self._commit_phase_over(step.round), f"round {step.round} to close")
        return delta

    def _commit_phase_over(self, round_: int) -> bool:
        """Whether round ``round_``'s commit phase is over, ended here if it may be."""
        coordinator = self._cluster.coordinator

        def everyone_in(opened: OpenRound) -> bool:
            with self._lock:
                dead = set(self._dead.get(round_, ()))
            return (
                opened.round == round_
                and opened.cohort <= opened.committed | opened.reported | dead
            )

        end_commit_phase_if(coordinator, everyone_in)
        return commit_phase_over(coordinator, round_)
