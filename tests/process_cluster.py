"""A fedps cluster of real processes for fault tests, and the plaintext replay they check.

Key holder, shards and coordinator run as ``python -m fedps.cli ROLE`` processes
(:class:`~fedps.runtime.deployment.Deployment`); the clients are :class:`RecordingClient` threads
(or processes, :mod:`tests.recording_client`) that remember the plaintext of what they pushed
and which rounds every shard acknowledged. After training, :func:`assert_replayed` checks that
the key holder applied every round with exactly the acknowledged clients and that its model
equals the plaintext FedAvg of exactly their updates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crypto.tls import OPERATOR_NAME, TlsIdentity
from fedps.config import FedPSConfig
from fedps.learning.tasks import load_task
from fedps.rpc.coordinator_messages import ClusterStatus
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.transport import channel_credentials
from fedps.runtime.deployment import Deployment
from fedps.runtime.export import pull_model, read_saved_model
from fedps.sharding.blocks import flatten_model
from server.coordinator.checkpoint_store import CheckpointStore
from server.coordinator.evaluator import Evaluator
from tests.conftest import RecordingClient, reached
from tests.role_processes import wait_serving, write_local_config
from tests.waiting import HANG_S, wait_for

__all__ = [
    "HANG_S",
    "Recorded",
    "assert_exported",
    "assert_replayed",
    "cluster_config",
    "exported_model",
    "keyholder_state",
    "recorded",
    "role_args",
    "role_env",
    "start_role",
    "start_servers",
    "status",
    "wait_for_round",
    "wait_ready",
]


@dataclass
class Recorded:
    """What one client pushed: ``sent[round] = (weight, delta)`` and the rounds whose push
    every shard that owns a block acknowledged."""

    client_id: str
    sent: dict[int, tuple[float, np.ndarray]] = field(default_factory=dict)
    acknowledged: set[int] = field(default_factory=set)


def recorded(clients: Sequence[RecordingClient]) -> list[Recorded]:
    """What in-process recording clients pushed."""
    return [Recorded(c.client_id, c.sent, c.acknowledged) for c in clients]


def cluster_config(
    tmp_path: Path,
    *,
    rounds: int,
    clients: int,
    cluster: Mapping[str, object] | None = None,
    training: Mapping[str, object] | None = None,
    keyholder: Mapping[str, object] | None = None,
) -> tuple[FedPSConfig, Path]:
    """A provisioned configuration for a process cluster on loopback, written to a file
    (``cluster``, ``training``, ``keyholder``: more fields of those sections)."""
    path, config = write_local_config(
        tmp_path,
        keyholder=keyholder or {},
        cluster=cluster or {},
        training={
            "rounds": rounds,
            "clients": clients,
            "min_quorum": 2,
            # Rounds end when every member committed and pushed; the deadline only ends a
            # round a member never finishes, so a loaded machine never decides one
            "deadline_s": 300.0,
            "checkpoint_every": 1,
            "lr": 0.3,
            **(training or {}),
        },
        # Flooding adds ~5e-6 of noise per value and round on purpose (docs/security.md);
        # off here, so the replay checks exact accounting at 1e-4, not the noise.
        security={"flood_bits": 0},
    )
    return config, path


def role_args(name: str) -> list[str]:
    """The ``fedps`` arguments that start role ``name`` (``keyholder``, ``shard-1``...)."""
    if name.startswith("shard-"):
        return ["shard", "--index", name.split("-")[1]]
    return [name]


def address_of(config: FedPSConfig, name: str) -> str:
    """Where role ``name`` listens."""
    cluster = config.cluster
    if name.startswith("shard-"):
        return cluster.shards[int(name.split("-")[1])]
    return cluster.keyholder if name == "keyholder" else cluster.coordinator


@contextmanager
def role_env(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment while a role process is started (it
    inherits it), removed after."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_role(deployment: Deployment, name: str, env: Mapping[str, str] | None = None) -> None:
    """Start role ``name`` (with ``env`` added to its environment) and wait until it serves."""
    with role_env(env or {}):
        deployment.start(name, *role_args(name))
    wait_ready(deployment, [name])


def start_servers(
    deployment: Deployment, envs: Mapping[str, Mapping[str, str]] | None = None
) -> None:
    """The key holder and the shards together, then the coordinator, as ``fedps up`` starts
    them (:meth:`Deployment.start_servers`), each with ``envs[ROLE]`` added to its
    environment; returns once all of them serve."""
    envs = envs or {}
    peers = ["keyholder", *(f"shard-{i}" for i in range(len(deployment.config.cluster.shards)))]
    for name in peers:
        with role_env(envs.get(name, {})):
            deployment.start(name, *role_args(name))
    wait_ready(deployment, peers)
    start_role(deployment, "coordinator", envs.get("coordinator"))


def wait_ready(deployment: Deployment, names: Sequence[str]) -> None:
    """:meth:`Deployment.wait_ready` for roles ``names`` (as the operator under mutual TLS,
    as it does), seeing each serve within 0.1 s of it
    (:func:`tests.role_processes.wait_serving`); raises if a role's process died."""
    tls = deployment.config.tls
    credentials = (
        channel_credentials(TlsIdentity.load(tls.directory, OPERATOR_NAME)) if tls.enabled else None
    )
    for name in names:
        wait_serving(address_of(deployment.config, name), deployment.check_alive, credentials)


def status(config: FedPSConfig) -> ClusterStatus:
    """The coordinator's status (one call; its deadline is only a hang guard: a loaded
    machine may take seconds to answer)."""
    client = CoordinatorStub(config.cluster.coordinator)
    try:
        return client.get_status(timeout_s=HANG_S)
    finally:
        client.close()


def wait_for_round(config: FedPSConfig, round_: int, *, finished: bool = False) -> ClusterStatus:
    """Wait until the coordinator finished ``round_`` (and, with ``finished``, the run)."""
    address = config.cluster.coordinator
    what = "the end of training" if finished else f"round {round_}"
    wait_for(lambda: reached(address, round_, finished=finished), what, poll_s=0.2)
    return status(config)


def keyholder_state(state_dir: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The key holder's saved model and metadata."""
    import io

    from crypto.files import read_checked

    path = state_dir / "keyholder" / "keyholder-state.npz"
    data = read_checked(path, what="key holder state", hint="")
    assert data is not None, "the key holder saved no state"
    with np.load(io.BytesIO(data)) as arrays:
        return arrays["params"], json.loads(bytes(arrays["meta"]).decode())


def replay(
    initial: np.ndarray, released: Mapping[str, Mapping[str, Any]], clients: list[Recorded]
) -> np.ndarray:
    """The plaintext FedAvg of exactly the updates the key holder says it applied (every
    block of a round holds exactly the same contributors)."""
    sent = {c.client_id: c.sent for c in clients}
    model = initial.copy()
    for round_ in sorted(released, key=int):
        weights: dict[str, float] = released[round_]["contributors"]
        summed = sum(weights[c] * sent[c][int(round_)][1] for c in weights)
        model = model + summed / sum(weights.values())
    return model


def assert_replayed(
    config: FedPSConfig,
    final: ClusterStatus,
    clients: list[Recorded],
    log: object = "",
    *,
    within: Callable[[Mapping[str, Mapping[str, Any]]], float] | None = None,
) -> None:
    """Training finished, every round applied with exactly the clients whose pushes were
    acknowledged, and the key holder's model is the plaintext replay of their updates (at
    1e-4 relative; ``within``: no value further off than it says, given the released rounds,
    as key-holder parties flood each release)."""
    rounds = config.training.rounds
    assert final.finished and final.round == rounds, log
    assert not any(r.abandoned for r in final.history), (final.history, log)
    applied, meta = keyholder_state(config.cluster.state_dir)
    assert meta["version"] == rounds, log
    released = meta["released"]
    for r in range(1, rounds + 1):
        acknowledged = {c.client_id for c in clients if r in c.acknowledged}
        assert set(released[str(r)]["contributors"]) == acknowledged, (r, log)
    initial = Evaluator(load_task(config), seed=config.training.seed).initial_vector()
    expected = replay(initial, released, clients)
    if within is not None:
        assert np.abs(applied - expected).max() <= within(released), log
        return
    assert np.linalg.norm(applied - expected) / np.linalg.norm(expected) < 1e-4, log


def exported_model(config: FedPSConfig) -> tuple[np.ndarray, int]:
    """The model ``fedps export`` pulls from the running cluster (flat) and its version."""
    model, version = pull_model(config)
    return flatten_model(model), version


def assert_exported(
    config: FedPSConfig, pulled: tuple[np.ndarray, int], *, version: int | None = None
) -> None:
    """``fedps export`` of the running cluster (``pulled``, :func:`exported_model`) and of the
    stopped one's state folder both give the model the coordinator evaluated last (its
    checkpoint), at ``version`` (None: one per round)."""
    checkpoint = CheckpointStore(config.cluster.state_dir / "coordinator").load()
    assert checkpoint is not None
    saved, saved_version = read_saved_model(config)
    expected = config.training.rounds if version is None else version
    assert pulled[1] == saved_version == expected
    assert np.array_equal(pulled[0], checkpoint.model)
    assert np.array_equal(flatten_model(saved), checkpoint.model)
