"""Staleness weights for asynchronous aggregation (FedAsync, Xie et al. 2019).

``staleness = published version now - version the client trained on``. A registered function
maps it to a weight in (0, 1]; shards apply it to ciphertexts as a fixed-point integer
multiplier (:func:`multiplier`), so weighting never needs a decryption, and the key holder
recomputes the same multipliers to normalise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from crypto.params import ASYNC_WEIGHT_BITS
from fedps._registry import add_entry
from fedps.errors import ConfigError

__all__ = ["create_staleness", "multiplier", "register_staleness"]

StalenessFn = Callable[[int], float]


def _constant(a: float, b: float) -> StalenessFn:
    return lambda s: 1.0


def _polynomial(a: float, b: float) -> StalenessFn:
    return lambda s: (1.0 + s) ** -a


def _hinge(a: float, b: float) -> StalenessFn:
    return lambda s: 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0)


_REGISTRY: dict[str, Callable[[float, float], StalenessFn]] = {
    "constant": _constant,
    "hinge": _hinge,
    "polynomial": _polynomial,
}


def register_staleness(name: str, factory: Callable[[float, float], StalenessFn]) -> None:
    """Make ``factory(a, b)`` available to :func:`create_staleness` as ``name``.

    The factory returns a weight function of the staleness; ``training.staleness`` names it.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_REGISTRY, name, factory, "staleness function")


def create_staleness(name: str, *, a: float = 0.5, b: float = 4.0) -> StalenessFn:
    """The staleness function ``name`` (constant, polynomial ``(1+s)^-a``, hinge).

    Raises
    ------
    ConfigError
        If ``name`` is not registered.
    """
    try:
        return _REGISTRY[name](a, b)
    except KeyError:
        raise ConfigError(
            f"unknown staleness function {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None


def multiplier(fn: StalenessFn, staleness: int) -> int:
    """The integer a ciphertext of this staleness is multiplied by.

    That is ``round(2**ASYNC_WEIGHT_BITS * w(s))``, at least 1.
    """
    return max(1, math.floor(fn(staleness) * (1 << ASYNC_WEIGHT_BITS) + 0.5))
