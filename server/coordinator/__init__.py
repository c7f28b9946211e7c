"""The coordinator: registration, rounds or buffers, evaluation and checkpoints.

Its names are imported on first use: a process that reads only one of its modules (a
configuration's check, :mod:`fedps.runtime.preflight`, builds the round policy of
:mod:`server.coordinator.round_policy`) does not load the coordinator and its model evaluation
(torch, seconds of CPU at each start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.coordinator.coordinator import Coordinator
    from server.coordinator.coordinator_servicer import CoordinatorServicer
    from server.coordinator.coordinator_settings import CoordinatorSettings

__all__ = ["Coordinator", "CoordinatorServicer", "CoordinatorSettings"]

# Each name and the module that defines it, imported on first use.
_LAZY = {
    "Coordinator": "server.coordinator.coordinator",
    "CoordinatorServicer": "server.coordinator.coordinator_servicer",
    "CoordinatorSettings": "server.coordinator.coordinator_settings",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'server.coordinator' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
