"""``fedps status``: which roles are up, the current round and version, the last checkpoint."""

from __future__ import annotations

import time

import typer

from fedps.config import FedPSConfig
from fedps.coordinator_client import CoordinatorClient
from fedps.errors import FedPSError
from fedps.keyholder_client import KeyHolderClient
from fedps.shard_client import ShardClient

__all__ = ["print_status"]


def print_status(config: FedPSConfig) -> None:
    """Print the cluster's health; raise :class:`FedPSError` if the coordinator is down."""
    cluster = config.cluster
    coordinator = CoordinatorClient(cluster.coordinator)
    try:
        status = coordinator.get_status(timeout_s=5)
    finally:
        coordinator.close()
    age = time.time() - status.last_checkpoint_unix if status.last_checkpoint_unix else None
    typer.echo(f"coordinator {cluster.coordinator}: up, run {status.run_id}")
    typer.echo(
        f"  round {status.round}, version {status.version}, {status.registered} clients, "
        f"{'finished' if status.finished else 'training'}, max epsilon "
        f"{status.max_epsilon:.3f} (delta {status.delta:g}), last checkpoint "
        f"{'never' if age is None else f'{age:.0f}s ago'}"
    )
    noise = status.noise or "secure"
    warning = "" if noise == "secure" else " (WARNING: anyone with the configuration can remove it)"
    typer.echo(f"  DP noise: {noise}{warning}")
    for client_id in sorted(status.client_epsilons):
        typer.echo(f"  {client_id}: epsilon {status.client_epsilons[client_id]:.3f}")
    keyholder = KeyHolderClient(cluster.keyholder)
    detections: dict[str, int] = {}
    quarantined: set[str] = set()
    try:
        state = keyholder.get_model_state(timeout_s=5)
        typer.echo(f"key holder {cluster.keyholder}: up, version {state.version}")
        detections, quarantined = dict(state.detections), set(state.quarantined)
    except FedPSError as exc:
        typer.echo(f"key holder {cluster.keyholder}: DOWN ({exc})")
    finally:
        keyholder.close()
    for sid, address in zip(cluster.shard_ids, cluster.shards, strict=True):
        shard = ShardClient(sid, address)
        suspect = ""
        if sid in detections:
            suspect = (
                f"; {'QUARANTINED' if sid in quarantined else 'SUSPECT'}: "
                f"{detections[sid]} tampered aggregate(s) detected by the key holder"
            )
        try:
            s = shard.get_status(timeout_s=5)
            typer.echo(
                f"{sid} {address}: up, version {s.version}, {s.blocks} blocks, "
                f"{s.pushes_accepted} pushes accepted, {s.pushes_refused} refused{suspect}"
            )
        except FedPSError as exc:
            typer.echo(f"{sid} {address}: DOWN ({exc}){suspect}")
        finally:
            shard.close()
