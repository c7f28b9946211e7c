"""``fedps status``: which roles are up, the current round and version, each shard's standing.

Also the last checkpoint. A shard's standing is the tampering the key holder detected in what it
sent, and the calls to it that missed their deadline (the key holder's fetches, the coordinator's
openings and closings of rounds).
"""

from __future__ import annotations

import time
from collections import Counter

import typer

from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.shard_stub import ShardStub

__all__ = ["print_status"]


def print_status(config: FedPSConfig) -> None:
    """Print the cluster's health; raise :class:`FedPSError` if the coordinator is down."""
    cluster = config.cluster
    coordinator = CoordinatorStub(cluster.coordinator)
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
    keyholder = KeyHolderStub(cluster.keyholder)
    detections: dict[str, int] = {}
    quarantined: set[str] = set()
    misses = Counter(status.shard_misses)
    stalled = set(status.stalled)
    try:
        state = keyholder.get_model_state(timeout_s=5)
        typer.echo(f"key holder {cluster.keyholder}: up, version {state.version}")
        detections, quarantined = dict(state.detections), set(state.quarantined)
        misses.update(state.shard_misses)
        stalled.update(state.stalled)
        for client_id, why in sorted(state.blamed.items()):
            typer.echo(f"  {client_id}: EXCLUDED, blamed on evidence ({why})")
    except FedPSError as exc:
        typer.echo(f"key holder {cluster.keyholder}: DOWN ({exc})")
    finally:
        keyholder.close()
    for sid, address in zip(cluster.shard_ids, cluster.shards, strict=True):
        shard = ShardStub(sid, address)
        standing = ""
        if sid in detections:
            standing = (
                f"; {'QUARANTINED' if sid in quarantined else 'SUSPECT'}: "
                f"{detections[sid]} tampered aggregate(s) detected by the key holder"
            )
        if misses[sid]:
            standing += f"; {'STALLED: ' if sid in stalled else ''}{misses[sid]} missed deadline(s)"
        try:
            s = shard.get_status(timeout_s=5)
            typer.echo(
                f"{sid} {address}: up, version {s.version}, {s.blocks} blocks, "
                f"{s.pushes_accepted} pushes accepted, {s.pushes_refused} refused{standing}"
            )
        except FedPSError as exc:
            typer.echo(f"{sid} {address}: DOWN ({exc}){standing}")
        finally:
            shard.close()
