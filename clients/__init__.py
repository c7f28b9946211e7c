"""fedps edge clients: local DP training, encryption and pushes to the shards."""

from clients.dp_trainer import ClientLevelTrainer, DPTrainer, create_trainer
from clients.edge_client import EdgeClient

__all__ = ["ClientLevelTrainer", "DPTrainer", "EdgeClient", "create_trainer"]
