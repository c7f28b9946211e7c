"""fedps edge clients: local DP-SGD training, encryption and pushes to the shards."""

from clients.dp_trainer import DPTrainer
from clients.edge_client import EdgeClient

__all__ = ["DPTrainer", "EdgeClient"]
