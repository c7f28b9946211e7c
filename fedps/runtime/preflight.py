"""Checks of a configuration before any process starts: every plug-in name is registered.

A misspelt name (``training.partition = "random"``) would otherwise pass validation and stop a
client minutes later, once the servers are up and the cohort is waiting. :func:`check_names`
builds each named part the configuration asks for the way its role will, so an unknown name is
the same one-line :class:`~fedps.errors.ConfigError`, with the valid names, before anything
starts. A task of the user's own (``task.app``) is loaded first: its module may register names.
"""

from __future__ import annotations

from fedps.config import FedPSConfig
from fedps.errors import ConfigError
from fedps.learning.datasets import dataset_names
from fedps.learning.partitioners import partitioner_names
from fedps.learning.staleness import create_staleness
from server.coordinator.round_policy import create_round_policy
from server.keyholder.server_optimizer import create_server_optimizer

__all__ = ["check_names"]


def check_names(config: FedPSConfig) -> None:
    """Check that every plug-in ``config`` names is registered.

    The round policy (``training.mode``), the server optimizer, the staleness function and,
    for a built-in task, the dataset, model and partitioner.

    Raises
    ------
    ConfigError
        Naming the field, the unknown name and the valid names.
    """
    # imported here: the models and tasks need torch, which a server-only install lacks (and a
    # role that checks nothing never imports)
    from fedps.learning.models import model_names
    from fedps.learning.tasks import load_task

    t = config.training
    if config.task.app:
        load_task(config)  # a user's task may register its own names on import
    else:
        _check("training.dataset", t.dataset, dataset_names())
        _check("training.model", t.model, model_names())
        _check("training.partition", t.partition, partitioner_names())
    for field, build in (
        ("training.mode", lambda: create_round_policy(t.mode, t)),
        ("training.server_optimizer", lambda: create_server_optimizer(t.server_optimizer, lr=1.0)),
        ("training.staleness", lambda: create_staleness(t.staleness)),
    ):
        try:
            build()
        except ConfigError as exc:
            raise ConfigError(f"{field}: {exc}") from None


def _check(field: str, name: str, valid: list[str]) -> None:
    if name not in valid:
        raise ConfigError(f"{field}: unknown name {name!r}; valid names: {', '.join(valid)}")
