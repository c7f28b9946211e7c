"""Server optimizers applied by the key holder to the decrypted average update.

The average client update ``delta`` acts as a pseudo-gradient (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021): FedAvg adds it, FedAvgM adds a momentum of it (Hsu et
al. 2019), FedAdam applies Adam to it. Pick one by name with :func:`create_server_optimizer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from fedps._registry import add_entry
from fedps.errors import ConfigError

__all__ = ["ServerOptimizer", "create_server_optimizer", "register_server_optimizer"]


class ServerOptimizer(ABC):
    """Turns the current model and the average update into the next model."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.state: dict[str, np.ndarray] = {}

    def step(
        self, params: np.ndarray, delta: np.ndarray, where: np.ndarray | None = None
    ) -> np.ndarray:
        """Return the next parameters (a new array).

        With ``where`` (a boolean mask), only those values and their optimizer state move;
        the others keep their parameters and state (a group that is not due yet).
        """
        if where is None:
            return self._step(params, delta)
        before = dict(self.state)
        stepped = self._step(params, delta)
        for key, value in self.state.items():
            old = before.get(key)
            self.state[key] = np.where(where, value, 0.0 if old is None else old)
        out: np.ndarray = np.where(where, stepped, params)
        return out

    @abstractmethod
    def _step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The optimizer's update of every value (updates ``state``)."""


class FedAvg(ServerOptimizer):
    """x <- x + lr * delta (McMahan et al. 2017)."""

    def _step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        out: np.ndarray = params + self.lr * delta
        return out


class FedAvgM(ServerOptimizer):
    """m <- beta * m + delta; x <- x + lr * m (Hsu et al. 2019)."""

    def __init__(self, lr: float, momentum: float = 0.9) -> None:
        super().__init__(lr)
        self.momentum = momentum

    def _step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        m = self.state.get("m", np.zeros_like(params))
        m = self.momentum * m + delta
        self.state["m"] = m
        out: np.ndarray = params + self.lr * m
        return out


class FedAdam(ServerOptimizer):
    """Adam on the pseudo-gradient, with tau as the adaptivity floor (Reddi et al. 2021)."""

    def __init__(
        self, lr: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def _step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        m = self.state.get("m", np.zeros_like(params))
        v = self.state.get("v", np.zeros_like(params))
        m = self.beta1 * m + (1 - self.beta1) * delta
        v = self.beta2 * v + (1 - self.beta2) * delta * delta
        self.state["m"], self.state["v"] = m, v
        out: np.ndarray = params + self.lr * m / (np.sqrt(v) + self.tau)
        return out


_OPTIMIZERS: dict[str, Callable[[float, float], ServerOptimizer]] = {
    "fedavg": lambda lr, _momentum: FedAvg(lr),
    "fedavgm": lambda lr, momentum: FedAvgM(lr, momentum),
    "fedadam": lambda lr, _momentum: FedAdam(lr),
}


def register_server_optimizer(
    name: str, factory: Callable[[float, float], ServerOptimizer]
) -> None:
    """Make ``factory(lr, momentum)`` available to :func:`create_server_optimizer` as ``name``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_OPTIMIZERS, name, factory, "server optimizer")


def create_server_optimizer(name: str, *, lr: float, momentum: float = 0.9) -> ServerOptimizer:
    """Build a registered server optimizer.

    Raises
    ------
    ConfigError
        If ``name`` is not one of ``fedavg``, ``fedavgm``, ``fedadam``.
    """
    try:
        factory = _OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown server optimizer {name!r}; choose one of {sorted(_OPTIMIZERS)}"
        ) from None
    return factory(lr, momentum)
