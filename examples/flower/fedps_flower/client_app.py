"""ClientApp: DP-SGD with Opacus, CKKS-encrypted pushes to the fedps shards.

Each node trains on partition ``partition-id`` of the configured dataset and replies with
metadata only (epsilon, weight, bytes pushed); the update goes to the shards, encrypted.
"""

from __future__ import annotations

from clients.flower.flower_client import create_client_app
from fedps_flower.settings import fedps_config

app = create_client_app(fedps_config)
