"""Tasks: the user's model, data, loss and metrics, behind one door.

A task is what fedps trains: a model factory, the loading of one client's own data, and
optionally the loss, the local optimizer, the metrics and an evaluation set the operator holds.
Write it as a module (Flower's ``task.py``) with these functions::

    def model() -> torch.nn.Module: ...                 # required, Opacus-compatible
    def load_data(client: ClientData) -> DataLike: ...   # this client's own data (*)
    def load_eval_data() -> DataLike: ...                # optional: the operator's held-out data
    def loss(outputs, targets) -> torch.Tensor: ...     # optional (default below)
    def metrics(outputs, targets) -> dict[str, float]: ...  # optional (default below)
    def optimizer(params, training) -> torch.optim.Optimizer: ...  # optional: SGD(lr, momentum)

(*) Every fedps client loads its data with it; a task for Flower nodes whose own ``train``
loads their data (:class:`clients.flower.fedps_mod.FedPSMod`) may leave it out.

Write it as such a module or as a :class:`Task` object. ``[task] app = "my_pkg.task"`` (or
``"my_pkg.task:obj"``) names it; the project directory (``[task] dir``, default the
configuration file's folder) is put on the path to import it, as Flower does with an app. A
registered name (:func:`register_task`, or an entry point in the ``fedps.learning.tasks`` group) is
looked up first; the built-in datasets are registered tasks: ``digits``, ``mnist5k`` and
``fashion_mnist`` (their model is ``training.model``, each client's data is partition
``--index`` of the training split, and the operator evaluates on the test split).

Data (:data:`DataLike`) is a :class:`~fedps.learning.datasets.Dataset`, an ``(x, y)`` pair of numpy
arrays or tensors, or a two-tensor ``TensorDataset``. Integer targets make a classification
task (default loss cross-entropy, default metrics accuracy), real targets a regression task
(default loss mean squared error). Every evaluation reports ``loss`` and the task's metrics.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias, TypeVar

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedps._registry import add_entry
from fedps.config import FedPSConfig, TrainingConfig
from fedps.errors import ConfigError, FedPSError
from fedps.learning.datasets import Dataset, dataset_names, load_dataset
from fedps.startup import root_logging_kept

__all__ = [
    "PLAIN_LAYERS",
    "ClientData",
    "DataLike",
    "Task",
    "check_dp_trainable",
    "evaluate_model",
    "load_task",
    "register_task",
    "task_names",
    "to_dataset",
]

DataLike: TypeAlias = Dataset | tuple[Any, Any] | TensorDataset
"""What a task's loaders may return (see the module's docstring)."""

ENTRY_POINT_GROUP = "fedps.tasks"
_EVAL_BATCH = 4096


@dataclass(frozen=True)
class ClientData:
    """What a task's ``load_data`` is told about the client it loads for.

    Parameters
    ----------
    path
        The client's own data (``fedps client --data PATH``); None when none was given.
    index
        The client's index (``fedps client --index``), for tasks that simulate clients by
        partitioning one dataset.
    num_clients
        ``training.clients``.
    seed
        ``training.seed``.
    """

    path: Path | None
    index: int = 0
    num_clients: int = 1
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Task:
    """A user's training task (see the module's docstring for each part)."""

    name: str
    model: Callable[[], torch.nn.Module]
    load_data: Callable[[ClientData], DataLike] | None = None
    load_eval_data: Callable[[], DataLike] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    metrics: Callable[[torch.Tensor, torch.Tensor], Mapping[str, float]] | None = None
    optimizer: Callable[[Iterable[torch.nn.Parameter], TrainingConfig], torch.optim.Optimizer] | (
        None
    ) = None

    def create_model(self, seed: int = 0) -> torch.nn.Module:
        """The task's model with deterministic initial weights.

        ``torch.manual_seed(seed)`` first, so every party builds the same one.
        """
        torch.manual_seed(seed)
        model = _user_call(self.name, "model()", self.model)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"task {self.name!r}: model() returned {type(model).__name__}")
        return model

    def client_data(self, client: ClientData) -> Dataset:
        """The client's own data, checked (:func:`to_dataset`)."""
        if self.load_data is None:
            raise ConfigError(
                f"task {self.name!r} has no load_data(client): a fedps client loads its own "
                "data with it (only a Flower node whose own train loads its data needs none)"
            )
        call = f"load_data({client.path or ''})"
        return to_dataset(
            _user_call(self.name, call, self.load_data, client), f"{self.name}: {call}"
        )

    def eval_data(self) -> Dataset | None:
        """The operator's held-out data, or None when the task has none."""
        if self.load_eval_data is None:
            return None
        data = _user_call(self.name, "load_eval_data()", self.load_eval_data)
        return to_dataset(data, f"{self.name}: load_eval_data()")

    def check_fit(self, model: torch.nn.Module, data: Dataset) -> None:
        """Check that ``model``'s outputs fit ``data``'s targets.

        One forward pass on a few examples: as many values as a regression target has, or a score
        for every class.

        Raises
        ------
        ConfigError
            Naming both shapes, and the likely fix.
        """
        sample = torch.from_numpy(data.x[:2])
        with torch.no_grad():
            outputs = _user_call(self.name, "the model's forward pass", model, sample)
        per_example = int(outputs[0].numel()) if outputs.ndim else 0
        if data.is_regression:
            wanted = int(np.prod(data.y.shape[1:]))
            if per_example != wanted:
                raise ConfigError(
                    f"task {self.name!r}: the model gives {per_example} values per example but "
                    f"the targets have {wanted} (real numbers: a regression); for classes, "
                    "return integer labels (y.astype(numpy.int64))"
                )
        elif outputs.ndim != 2 or per_example < data.num_classes:
            raise ConfigError(
                f"task {self.name!r}: the model gives outputs of shape {tuple(outputs.shape)} "
                f"for 2 examples, but the labels need a score for each of {data.num_classes} "
                "classes"
            )

    def loss_fn(self, regression: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The task's loss, or the default for its targets."""
        if self.loss is not None:
            return self.loss
        return _mse if regression else torch.nn.functional.cross_entropy

    def create_optimizer(
        self, params: Iterable[torch.nn.Parameter], training: TrainingConfig
    ) -> torch.optim.Optimizer:
        """The task's local optimizer, or SGD with ``training.lr`` and ``training.momentum``."""
        if self.optimizer is not None:
            return self.optimizer(params, training)
        return torch.optim.SGD(params, lr=training.lr, momentum=training.momentum)


_T = TypeVar("_T")


def _user_call(task: str, what: str, function: Callable[..., _T], *args: object) -> _T:
    """Call the user's ``function``.

    Its failure becomes one ConfigError naming the task and the call (its traceback kept as the
    cause).
    """
    try:
        return function(*args)
    except FedPSError:
        raise
    except Exception as exc:
        raise ConfigError(f"task {task!r}: {what} failed: {type(exc).__name__}: {exc}") from exc


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs.reshape(targets.shape), targets)


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"accuracy": float((outputs.argmax(dim=1) == targets).float().mean().item())}


def to_dataset(data: DataLike, what: str = "data") -> Dataset:
    """Check a task's data and hold it as a :class:`~fedps.learning.datasets.Dataset`.

    Features as float32; integer targets are class labels (classes ``0..max``), real ones regression
    targets.

    Raises
    ------
    ConfigError
        Data of another kind, of mismatched lengths, empty, or with non-finite features.
    """
    if isinstance(data, Dataset):
        return data
    if isinstance(data, TensorDataset):
        if len(data.tensors) != 2:
            raise ConfigError(f"{what}: a TensorDataset of (features, targets), not {data!r}")
        data = (data.tensors[0], data.tensors[1])
    if not isinstance(data, tuple) or len(data) != 2:
        raise ConfigError(
            f"{what}: returned {type(data).__name__}; return (features, targets) arrays, a "
            "TensorDataset or a fedps Dataset"
        )
    x, y = (
        v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in data
    )
    if x.ndim == 0:
        raise ConfigError(f"{what}: features need one row per example, not a scalar")
    if y.ndim == 0:
        raise ConfigError(f"{what}: targets need one target per row, not a scalar")
    if x.ndim == 1:
        x = x[:, None]
    if len(x) == 0 or len(x) != len(y):
        raise ConfigError(f"{what}: {len(x)} feature rows and {len(y)} targets")
    if x.dtype.kind not in "fiub" or not np.all(np.isfinite(x)):
        raise ConfigError(f"{what}: features must be finite numbers")
    features = np.ascontiguousarray(x, dtype=np.float32)
    if y.dtype.kind in "iub":
        if int(y.min()) < 0:
            raise ConfigError(f"{what}: class labels must be 0, 1, ...; got {int(y.min())}")
        if y.ndim > 2 or (y.ndim == 2 and y.shape[1] != 1):
            raise ConfigError(f"{what}: one class label per row, not targets of shape {y.shape}")
        labels = np.ascontiguousarray(y, dtype=np.int64).reshape(-1)
        return Dataset(features, labels, int(labels.max()) + 1, what)
    if y.dtype.kind != "f" or not np.all(np.isfinite(y)):
        raise ConfigError(f"{what}: targets must be integer labels or finite real values")
    return Dataset(features, np.ascontiguousarray(y, dtype=np.float32), 0, what)


def evaluate_model(task: Task, model: torch.nn.Module, data: Dataset) -> dict[str, float]:
    """``loss`` and the task's metrics of ``model`` on ``data`` (mean over the examples)."""
    loss_fn = task.loss_fn(data.is_regression)
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(data), _EVAL_BATCH):
            outputs.append(model(torch.from_numpy(data.x[start : start + _EVAL_BATCH])))
    out, targets = torch.cat(outputs), torch.from_numpy(data.y)
    with torch.no_grad():
        values = {"loss": float(loss_fn(out, targets).item())}
        if task.metrics is not None:
            values.update({k: float(v) for k, v in task.metrics(out, targets).items()})
        elif not data.is_regression:
            values.update(_accuracy(out, targets))
    return values


# The registry: names of tasks, each a Task or a factory of one from the configuration.
TaskFactory: TypeAlias = Callable[[FedPSConfig], Task]
_TASKS: dict[str, Task | TaskFactory] = {}


def register_task(name: str, task: Task | TaskFactory | ModuleType) -> None:
    """Make ``task`` available as ``[task] app = NAME`` in this process.

    It is a :class:`Task`, a module of task functions, or a factory ``(config) -> Task``; for
    clients run from a script and tests. Roles started as processes (``fedps up``) find a name
    through the ``fedps.learning.tasks`` entry-point group, or a module through ``[task] dir``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_TASKS, name, _as_task(task, name) if isinstance(task, ModuleType) else task, "task")


def task_names() -> list[str]:
    """Registered task names (entry points of the ``fedps.learning.tasks`` group included)."""
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted({*_TASKS, *(e.name for e in entry_points)})


def load_task(config: FedPSConfig) -> Task:
    """The task ``config.task.app`` names (see the module's docstring).

    Raises
    ------
    ConfigError
        If the task cannot be found or imported, or lacks ``model`` or ``load_data``.
    """
    app = config.task.app or config.training.dataset
    found: object = _TASKS.get(app)
    if found is None and app in dataset_names():  # a dataset registered after import
        found = _builtin(app)
    if found is None:
        entry = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).select(name=app)
        if entry:
            found = _user_call(app, "loading its entry point", next(iter(entry)).load)
        else:
            found = _import(app, config.task.dir)
    if isinstance(found, Task):
        return found
    if callable(found) and not isinstance(found, ModuleType) and not _looks_like_task(found):
        task = found(config)
        if not isinstance(task, Task):
            raise ConfigError(f"task factory {app!r} returned {type(task).__name__}, not a Task")
        return task
    return _as_task(found, app)


def _import(app: str, project_dir: str) -> object:
    """Import ``module`` or ``module:attr`` with ``project_dir`` on the path."""
    module_name, _, attr = app.partition(":")
    if project_dir and project_dir not in sys.path:
        sys.path.append(project_dir)  # after fedps's own packages: a user file cannot shadow
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # the task's own module (or a package on its way) is missing, not one it imports
        if exc.name is not None and (
            exc.name == module_name or module_name.startswith(exc.name + ".")
        ):
            raise ConfigError(
                f"task {app!r}: no module {exc.name!r} in {project_dir or 'the path'} (task.app "
                f"names a module of the project, or one of {', '.join(task_names())})"
            ) from None
        raise ConfigError(f"task {app!r}: importing it failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"task {app!r}: importing it failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not attr:
        return module
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"task {app!r}: module {module_name!r} has no {attr!r}") from None


def _looks_like_task(obj: object) -> bool:
    return callable(getattr(obj, "model", None)) and callable(getattr(obj, "load_data", None))


def _as_task(obj: object, name: str) -> Task:
    """A :class:`Task` from an object (a module) with task functions as attributes."""
    if isinstance(obj, Task):
        return obj
    if not callable(getattr(obj, "model", None)):
        raise ConfigError(
            f"task {name!r} has no model(): a task provides model() and load_data(client), "
            "and optionally load_eval_data(), loss(outputs, targets), metrics(outputs, "
            "targets) and optimizer(params, training)"
        )
    optional = {
        f: getattr(obj, f)
        for f in ("load_data", "load_eval_data", "loss", "metrics", "optimizer")
        if callable(getattr(obj, f, None))
    }
    return Task(name=name, model=obj.model, **optional)  # type: ignore[attr-defined]


def _builtin(dataset: str) -> TaskFactory:
    """The built-in task of a dataset.

    Model ``training.model``, client data = partition ``index`` of the training split (a
    simulation), evaluation on the test split.
    """

    def factory(config: FedPSConfig) -> Task:
        from fedps.learning.models import create_model
        from fedps.learning.partitioners import create_partitioner

        t = config.training

        def splits() -> tuple[Dataset, Dataset]:
            return load_dataset(dataset, data_dir=t.data_dir)

        def model() -> torch.nn.Module:
            train, _ = splits()
            return create_model(
                t.model, num_features=train.num_features, num_classes=train.num_classes, seed=t.seed
            )

        def load_data(client: ClientData) -> Dataset:
            if client.path is not None:
                raise ConfigError(
                    f"the built-in {dataset} task has no per-client files (--data); its clients "
                    "are partitions of one dataset (--index); name your own task in [task] app"
                )
            if not 0 <= client.index < client.num_clients:
                raise ConfigError(
                    f"client index {client.index} out of range [0, {client.num_clients})"
                )
            train, _ = splits()
            kwargs: dict[str, object] = {}
            if t.partition == "dirichlet":
                kwargs = {"alpha": t.dirichlet_alpha}
            elif t.partition == "shard":
                kwargs = {"num_shards_per_partition": t.shards_per_client}
            labels = train.y.astype(np.int64)
            parts = create_partitioner(t.partition, **kwargs).partition(
                labels, client.num_clients, client.seed
            )
            idx = parts[client.index]
            return replace(train, x=train.x[idx], y=train.y[idx])

        def load_eval_data() -> Dataset:
            return splits()[1]

        return Task(name=dataset, model=model, load_data=load_data, load_eval_data=load_eval_data)

    return factory


for _dataset in ("digits", "fashion_mnist", "mnist5k"):
    _TASKS[_dataset] = _builtin(_dataset)


#: Layers with parameters of their own that Opacus trains as they are: it registers no validator
#: for them (a test pins them against its registry). Opacus validates only the layers that hold
#: trainable parameters, each by its exact type.
PLAIN_LAYERS = frozenset(
    {
        torch.nn.Linear,
        torch.nn.Conv1d,
        torch.nn.Conv2d,
        torch.nn.Conv3d,
        torch.nn.Embedding,
        torch.nn.LayerNorm,
        torch.nn.GroupNorm,
    }
)


def check_dp_trainable(model: torch.nn.Module, task: str) -> None:
    """Refuse a model that Opacus cannot train with per-sample gradients (example-level DP).

    Checked by each client, and by the coordinator when it starts, so that ``fedps up`` stops on it
    rather than waiting for clients that all refuse. A model in training mode whose trainable
    layers are all :data:`PLAIN_LAYERS` passes without Opacus's validators: importing Opacus costs
    3 s of CPU, which the coordinator would spend on this check only.

    Raises
    ------
    ConfigError
        Naming every offending layer (BatchNorm and the like) and the fix.
    """
    trainable = [
        m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if model.training and all(type(m) in PLAIN_LAYERS for m in trainable):
        return
    with root_logging_kept():  # here: Opacus pulls in torch, and configures the root logger
        from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        # name the layers (Opacus's errors name only their kind), each with its first sentence
        layers = [
            f"layer {name!r} ({type(module).__name__}): {_first_sentence(layer_errors[0])}"
            for name, module in model.named_modules()
            if next(module.children(), None) is None
            and (layer_errors := ModuleValidator.validate(module, strict=False))
        ]
        found = "; ".join(layers or [str(e) for e in errors])
        raise ConfigError(
            f"task {task!r}: the model cannot be trained with DP-SGD: {found}. Fix it in the "
            "task's model(): return opacus.validators.ModuleValidator.fix(model) (BatchNorm "
            "becomes GroupNorm), or replace the layers yourself"
        )


def _first_sentence(error: Exception) -> str:
    text = str(error)
    return text[: text.index(". ")] if ". " in text else text.rstrip(".")
