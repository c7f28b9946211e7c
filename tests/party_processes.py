"""A process cluster with key-holder parties: P = 3 party processes, any T = 2 decrypt.

Every role is a ``python -m fedps.cli`` process (:class:`~fedps.runtime.deployment.Deployment`,
parties first, as ``fedps up`` starts them), without TLS, so the test process can call the
roles and run :class:`RecordingClient` threads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crypto import threshold as th
from crypto.params import TAIL_SIGMAS
from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig
from fedps.runtime.deployment import Deployment, local_cluster
from tests.role_processes import wait_serving, write_local_config

__all__ = ["PARTIES", "THRESHOLD", "flooding_bound", "party_config", "start_party"]

PARTIES, THRESHOLD = 3, 2


def party_config(
    tmp_path: Path, *, rounds: int, clients: int, **sections: Mapping[str, object]
) -> tuple[FedPSConfig, Path]:
    """A provisioned configuration of a loopback cluster with key-holder parties, written.

    ``sections``: further sections of the configuration (``security``, say).
    """
    chosen: dict[str, Mapping[str, object]] = {
        "cluster": local_cluster(tmp_path / "state", parties=PARTIES),
        "training": {
            "rounds": rounds,
            "clients": clients,
            "min_quorum": 2,
            "deadline_s": 300.0,  # rounds end when every member pushed (see process_cluster)
            "checkpoint_every": 1,
            "lr": 0.3,
        },
        "keyholder": {"parties": PARTIES, "threshold": THRESHOLD, "lambda_bits": 16},
        **sections,
    }
    path, config = write_local_config(tmp_path, "fedps.toml", **chosen)
    return config, path


def start_party(deployment: Deployment, index: int) -> None:
    """Start (again) party ``index``'s process, and wait until it serves."""
    name = f"party-{index}"
    deployment.start(name, "keyholder", "--party", str(index))
    address = deployment.config.cluster.parties[index - 1]
    wait_serving(address, lambda: deployment.check_alive([name]))  # others may be down


def flooding_bound(config: FedPSConfig, released: Mapping[str, Mapping[str, Any]]) -> float:
    """The most the parties' flooding and joint decryption move a value of the model over the
    ``released`` rounds (each round's error divided by its total weight, as FedAvg divides)."""
    params = ckks_params(config)
    keyholder = config.keyholder
    bound = 0.0
    for record in released.values():
        weights: Mapping[str, float] = record["contributors"]
        n = len(weights)
        sigma = th.flooding_std(
            params, n, parties=keyholder.parties, lambda_bits=keyholder.lambda_bits
        )
        flooding = TAIL_SIGMAS * math.sqrt(keyholder.quorum) * sigma
        error = (flooding + th.joint_value_bound(params, n, keyholder.parties)) / params.scale
        bound += error / sum(weights.values())
    return bound
