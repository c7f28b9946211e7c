"""The coordinator: registration, rounds or buffers, evaluation and checkpoints."""

from server.coordinator.coordinator import Coordinator
from server.coordinator.coordinator_servicer import CoordinatorServicer
from server.coordinator.coordinator_settings import CoordinatorSettings

__all__ = ["Coordinator", "CoordinatorServicer", "CoordinatorSettings"]
