"""Every plug-in registry pairs ``create_*`` with ``register_*`` (Opacus's
``register_accountant``): a registered name is created like a built-in one, and a name taken
twice is a ValueError."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest
import torch

import clients.dp_trainer
import fedps.learning.datasets
import fedps.learning.models
import fedps.learning.partitioners
import fedps.learning.staleness
import server.keyholder.server_optimizer
from fedps.config import PrivacyConfig, TrainingConfig
from fedps.learning.datasets import Dataset


class _Halves(fedps.learning.partitioners.Partitioner):
    """The first half of the rows, then the rest (whatever the labels)."""

    def _partition(
        self, labels: np.ndarray, num_partitions: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        return list(np.array_split(np.arange(len(labels), dtype=np.int64), num_partitions))


class _Trainer(clients.dp_trainer.DPTrainer):
    """A trainer subclass: what a new privacy level would register."""


def _tiny_data() -> Dataset:
    return Dataset(np.zeros((4, 2), np.float32), np.array([0, 1, 0, 1]), 2, "tiny")


@dataclass(frozen=True)
class _Case:
    module: ModuleType
    registry: str
    register: Callable[[str, object], None]
    create: Callable[[str], object]
    check: Callable[[object], bool]


_CASES = {
    "model": _Case(
        fedps.learning.models,
        "_MODELS",
        fedps.learning.models.register_model,  # type: ignore[arg-type]
        lambda name: fedps.learning.models.create_model(name, num_features=3, num_classes=2),
        lambda model: isinstance(model, torch.nn.Bilinear),
    ),
    "dataset": _Case(
        fedps.learning.datasets,
        "_LOADERS",
        fedps.learning.datasets.register_dataset,  # type: ignore[arg-type]
        lambda name: fedps.learning.datasets.load_dataset(name),
        lambda splits: isinstance(splits, tuple) and splits[0].name == "tiny",
    ),
    "partitioner": _Case(
        fedps.learning.partitioners,
        "_PARTITIONERS",
        fedps.learning.partitioners.register_partitioner,  # type: ignore[arg-type]
        lambda name: fedps.learning.partitioners.create_partitioner(name).partition(
            np.zeros(6, np.int64), 2, 0
        ),
        lambda parts: [len(p) for p in parts] == [3, 3],  # type: ignore[attr-defined]
    ),
    "staleness": _Case(
        fedps.learning.staleness,
        "_REGISTRY",
        fedps.learning.staleness.register_staleness,  # type: ignore[arg-type]
        lambda name: fedps.learning.staleness.create_staleness(name, a=0.25)(3),
        lambda weight: weight == 0.25,
    ),
    "server optimizer": _Case(
        server.keyholder.server_optimizer,
        "_OPTIMIZERS",
        server.keyholder.server_optimizer.register_server_optimizer,  # type: ignore[arg-type]
        lambda name: server.keyholder.server_optimizer.create_server_optimizer(name, lr=0.5),
        lambda opt: isinstance(opt, server.keyholder.server_optimizer.ServerOptimizer),
    ),
    "trainer": _Case(
        clients.dp_trainer,
        "_TRAINERS",
        clients.dp_trainer.register_trainer,  # type: ignore[arg-type]
        lambda name: clients.dp_trainer.create_trainer(
            torch.nn.Linear(2, 2),
            _tiny_data(),
            training=TrainingConfig(),
            # a level the configuration does not know yet: as a plug-in's would be
            privacy=PrivacyConfig().model_copy(update={"level": name}),
        ),
        lambda trainer: isinstance(trainer, _Trainer),
    ),
}

_ENTRIES: dict[str, object] = {
    "model": lambda features, classes: torch.nn.Bilinear(features, features, classes),
    "dataset": lambda _dir: (_tiny_data(), _tiny_data()),
    "partitioner": _Halves,
    "staleness": lambda a, b: lambda s: a,
    "server optimizer": lambda lr, momentum: server.keyholder.server_optimizer.FedAvg(lr),
    "trainer": _Trainer,
}


@pytest.mark.parametrize("kind", sorted(_CASES))
def test_registered_name_is_created_and_taken_twice_is_refused(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a copy of the registry, restored after the test
    case = _CASES[kind]
    monkeypatch.setattr(case.module, case.registry, dict(getattr(case.module, case.registry)))

    # Execute
    case.register("test-entry", _ENTRIES[kind])
    created = case.create("test-entry")

    # Assert
    assert case.check(created)
    with pytest.raises(ValueError, match="'test-entry' is already registered"):
        case.register("test-entry", _ENTRIES[kind])
    with pytest.raises(ValueError, match="non-empty name"):
        case.register("", _ENTRIES[kind])
