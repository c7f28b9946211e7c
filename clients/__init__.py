"""fedps edge clients: local DP training, encryption and pushes to the shards.

Their privacy ledger survives restarts.
"""

from clients.client_state import ClientState
from clients.dp_trainer import ClientLevelTrainer, DPTrainer, create_trainer
from clients.edge_client import EdgeClient
from clients.simulation import SimulatedDevice

__all__ = [
    "ClientLevelTrainer",
    "ClientState",
    "DPTrainer",
    "EdgeClient",
    "SimulatedDevice",
    "create_trainer",
]
