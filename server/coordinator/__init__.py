"""The coordinator: registration, rounds or buffers, evaluation and checkpoints."""

from server.coordinator.coordinator import Coordinator
from server.coordinator.coordinator_servicer import CoordinatorServicer

__all__ = ["Coordinator", "CoordinatorServicer"]
