"""The Python API for scripts and notebooks: run a client, read back the model.

These functions are exported from the top-level package (``fedps.run_client``,
``fedps.load_model``, ``fedps.export_model``; see docs/api.md), next to
:class:`~fedps.runtime.local_cluster.LocalCluster` and :func:`~fedps.runtime.history.read_history`.
Every one takes the configuration as a :class:`~fedps.config.FedPSConfig` or the path of its
TOML file.

TLS is process-wide (one identity per process): a process that calls the cluster as the
operator (:func:`load_model`, :func:`read_history`, a ``LocalCluster``) cannot also be an edge
client under mutual TLS. In-process clients (:func:`run_client` in threads) therefore need
``[tls] insecure = true``; under TLS, run each client in its own process
(:meth:`LocalCluster.start_client <fedps.runtime.local_cluster.LocalCluster.start_client>` or
``fedps client``).

The library logs through the ``fedps`` logger. The first call of this API gives that logger
level INFO (unless it has a level already) and a handler that prints to stderr while the
application has configured no logging of its own (the root logger has no handler), as Flower
does; once it has, fedps's lines go to the application's handlers only, never twice.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from clients.edge_client import ClientSummary, EdgeClient
from clients.simulation import SimulatedDevice
from crypto.tls import OPERATOR_NAME
from fedps.learning.tasks import Task
from fedps.runtime.api_base import ConfigLike, as_config, enable_default_logging, use_identity
from fedps.runtime.export import export_model as _export_model
from fedps.runtime.export import pull_model

__all__ = [
    "ClientSummary",
    "ConfigLike",
    "as_config",
    "enable_default_logging",
    "export_model",
    "load_model",
    "run_client",
    "use_identity",
]

_log = logging.getLogger("fedps")


def run_client(
    config: ConfigLike,
    *,
    index: int = 0,
    data: str | os.PathLike[str] | None = None,
    task: Task | None = None,
    name: str = "",
    state_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 3600.0,
) -> ClientSummary:
    """Run edge client ``index`` in this thread until training is done, as ``fedps client``.

    Parameters
    ----------
    config
        The cluster's configuration, or the path of its TOML file.
    index
        The client's number: its identity ``client-INDEX`` and, for a built-in dataset, its
        partition.
    data
        The client's own data, given to the task's ``load_data``.
    task
        The task to train (default: the configured ``[task] app``). The coordinator evaluates
        with the configured task, so both should be the same.
    name
        A display name for the logs.
    state_dir
        Where the client keeps its signing key and privacy ledger (default:
        ``clients/client-INDEX`` in ``cluster.state_dir``).
    timeout_s
        The longest the run may take.

    Returns
    -------
    ClientSummary
        Its client id, rounds trained, privacy spent (epsilon at delta) and bytes pushed.

    Raises
    ------
    FedPSError
        The configuration, the data or the task is invalid, the client is refused, or (under
        mutual TLS) this process speaks as another identity already (see the module's
        docstring).
    """
    enable_default_logging()
    cfg = as_config(config)
    use_identity(cfg, f"client-{index}")
    client = EdgeClient.open(
        cfg,
        index=index,
        name=name,
        state_dir=Path(state_dir) if state_dir is not None else None,
        mods=[SimulatedDevice(cfg.training, index=index)],
        data=Path(data) if data is not None else None,
        task=task,
        on_round=lambda progress: _log.info("%s", progress.line()),
    )
    try:
        return client.run(timeout_s=timeout_s)
    finally:
        client.close()


def load_model(config: ConfigLike, *, task: Task | None = None) -> torch.nn.Module:
    """The trained global model: the task's model with the published weights.

    Pulled from the running cluster's shards with the key holder's signature checked (as
    ``fedps export``).

    Parameters
    ----------
    config
        The cluster's configuration, or the path of its TOML file.
    task
        The task whose model to fill (default: the configured one).

    Raises
    ------
    FedPSError
        The cluster is unreachable, the key holder is not the pinned one
        (``security.keyholder_key``), a block's signature does not verify, or the model does
        not fit the task's.
    """
    enable_default_logging()
    cfg = as_config(config)
    use_identity(cfg, OPERATOR_NAME)
    model, _ = pull_model(cfg, task=task)
    return model


def export_model(
    config: ConfigLike, path: str | os.PathLike[str], *, task: Task | None = None
) -> Path:
    """Write the trained global model's ``state_dict`` to ``path`` (``torch.save``).

    Checked as :func:`load_model` checks it; ``model.load_state_dict(torch.load(path))`` loads it
    into the task's model. Returns the path.

    Raises
    ------
    FedPSError
        As :func:`load_model`, or ``path`` cannot be written.
    """
    enable_default_logging()
    cfg = as_config(config)
    use_identity(cfg, OPERATOR_NAME)
    _export_model(cfg, Path(path), task=task)
    return Path(path)
