"""``fedps status``: which roles are up, the current round and version, each shard's standing.

Key-holder parties are each named up or down (asked directly, as the operator), with one line
saying rounds wait when fewer than ``T`` of them are up.

Also the last checkpoint and where the last round's time went (its critical path). A shard's
standing is the tampering the key holder detected in what it sent, and the calls to it that
missed their deadline (the key holder's fetches, the coordinator's openings and closings of
rounds). ``--json`` writes the coordinator's whole status (:func:`status_json`), every round
with its phases.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter

import typer

from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.shard_stub import ShardStub

__all__ = [
    "client_lines",
    "party_lines",
    "party_states",
    "phase_line",
    "print_status",
    "status_json",
]


def status_json(status: ClusterStatus) -> str:
    """The coordinator's status as a JSON object, indented, with a final newline.

    Every field under its name, each round of the history with its phases.
    """
    return json.dumps(dataclasses.asdict(status), indent=2) + "\n"


def phase_line(record: RoundSummary) -> str:
    """A round's critical path in one line, its largest phases first.

    Such as ``round 3, 0.74 s: train 0.31, noise 0.12, barrier 0.09, ...`` (empty: the round
    has no phases).
    """
    if not record.phases:
        return ""
    ranked = sorted(record.phases.items(), key=lambda item: -item[1])
    parts = ", ".join(f"{name} {seconds:.3g}" for name, seconds in ranked if seconds > 0)
    return f"round {record.round}, {record.seconds:.2f} s: {parts}"


def client_lines(status: ClusterStatus) -> list[str]:
    """One line per client: the server's epsilon, and what the client says where it differs.

    Such as ``client-0: epsilon 2.889 (it reports 2.165), SPENT: the server's ledger stops
    it at the target, WARNED (see the privacy warnings)`` (``client_epsilons`` is the server's
    figure).
    """
    spent, flagged = set(status.spent_clients), set(status.flagged_clients)
    lines = []
    for client_id, figure in sorted(status.client_epsilons.items()):
        line = f"{client_id}: epsilon {figure:.3f}"
        own = status.client_reported_epsilons.get(client_id)
        if own is not None and f"{own:.3f}" != f"{figure:.3f}":
            line += f" (it reports {own:.3f})"
        if client_id in spent:
            line += ", SPENT: the server's ledger stops it at the target"
        if client_id in flagged:
            line += ", WARNED (see the privacy warnings)"
        lines.append(line)
    return lines


def party_states(config: FedPSConfig, timeout_s: float = 5.0) -> dict[int, str]:
    """Each key-holder party's state by index: ``""`` when it is up, else why it is not.

    A party is up when it answers its hello with the joint public context (its key
    generation finished); ``{}`` without parties.
    """
    if config.keyholder.parties <= 1:
        return {}
    n = ckks_params(config).poly_modulus_degree
    states = {}
    for j, address in enumerate(config.cluster.parties, start=1):
        party = KeyHolderPartyStub(address, n=n, timeout_s=timeout_s)
        try:
            hello = party.hello()
            states[j] = "" if hello.context else "generating the joint key"
        except FedPSError as exc:
            states[j] = str(exc)
        finally:
            party.close()
    return states


def party_lines(config: FedPSConfig, states: dict[int, str]) -> list[str]:
    """One line per key-holder party (up, or DOWN and why), then one if rounds must wait.

    Such as ``rounds WAIT: 1 of 3 key-holder parties up, 2 must decrypt; down: party 1, party
    3`` when fewer than ``T`` are up.
    """
    lines = []
    for j, why in sorted(states.items()):
        address = config.cluster.parties[j - 1]
        lines.append(f"party-{j} {address}: {'up' if not why else f'DOWN ({why})'}")
    down = [j for j, why in sorted(states.items()) if why]
    must = config.keyholder.quorum
    if states and len(states) - len(down) < must:
        lines.append(
            f"rounds WAIT: {len(states) - len(down)} of {len(states)} key-holder parties up, "
            f"{must} must decrypt; down: " + ", ".join(f"party {j}" for j in down)
        )
    return lines


def print_status(config: FedPSConfig) -> ClusterStatus:
    """Print the cluster's health; returns the coordinator's status.

    Raises :class:`FedPSError` if the coordinator is down.
    """
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
    if status.history and (line := phase_line(status.history[-1])):
        typer.echo(f"  critical path of {line}")
    for line in client_lines(status):
        typer.echo(f"  {line}")
    for warning in status.privacy_warnings:
        typer.echo(f"  PRIVACY WARNING: {warning}")
    if status.ring_nodes:
        typer.echo(f"  shard ring version {status.ring_version}: {', '.join(status.ring_nodes)}")
    for move in status.ring_moves:
        typer.echo(f"  {move}")
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
    for line in party_lines(config, party_states(config)):
        typer.echo(line)
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
        if status.ring_nodes and sid not in status.ring_nodes:
            gone = any(f" {sid} removed " in m for m in status.ring_moves)
            standing += (
                "; OFF THE RING (declared gone: its blocks moved)"
                if gone
                else "; OFF THE RING (standby: fedps shard --join adds it)"
            )
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
    return status
