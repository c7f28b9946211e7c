"""Tests for fedps.learning.tasks: a task as a module, an object, a ``module:attr`` or an entry
point of the ``fedps.tasks`` group; data checked into a Dataset; evaluation with the task's
metrics."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import fedps.learning.tasks
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError
from fedps.learning.datasets import Dataset
from fedps.learning.tasks import (
    _PLAIN_LAYERS,
    ClientData,
    DataLike,
    Task,
    check_dp_trainable,
    evaluate_model,
    load_task,
    register_task,
    task_names,
    to_dataset,
)

_WINE_TASK = """
import torch
from sklearn.datasets import load_wine

from fedps.learning.tasks import Task


def model():
    return torch.nn.Linear(13, 3)


def load_data(client):
    x, y = load_wine(return_X_y=True)
    return x[client.index :: client.num_clients], y[client.index :: client.num_clients]


def load_eval_data():
    x, y = load_wine(return_X_y=True)
    return x[:20], y[:20]


task = Task(name="wine", model=model, load_data=load_data, load_eval_data=load_eval_data)
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project folder for user modules named ``user_*``; sys.path, the task registry and
    the imported modules are as before afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_task appends the project folder
    monkeypatch.setattr(fedps.learning.tasks, "_TASKS", dict(fedps.learning.tasks._TASKS))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("user_")]:
        del sys.modules[name]


def _write(project: Path, module: str, source: str) -> None:
    (project / f"{module}.py").write_text(textwrap.dedent(source))


def _config(project: Path, app: str) -> FedPSConfig:
    return load_config(None, task={"app": app, "dir": str(project)}, training={"clients": 2})


def _client(index: int = 0) -> ClientData:
    return ClientData(path=None, index=index, num_clients=2, seed=0)


def test_module_task_gives_model_data_and_eval_data(project: Path) -> None:
    # Prepare
    _write(project, "user_wine", _WINE_TASK)

    # Execute
    task = load_task(_config(project, "user_wine"))
    model = task.create_model(seed=3)
    data = task.client_data(_client(1))
    held_out = task.eval_data()

    # Assert
    assert task.name == "user_wine"
    assert isinstance(model, torch.nn.Linear)
    assert (len(data), data.num_features, data.num_classes) == (89, 13, 3)
    assert held_out is not None and len(held_out) == 20
    assert task.loss is None and task.metrics is None  # the defaults apply


def test_module_attr_names_a_task_object(project: Path) -> None:
    # Prepare
    _write(project, "user_wine_obj", _WINE_TASK)

    # Execute
    task = load_task(_config(project, "user_wine_obj:task"))

    # Assert
    assert task.name == "wine"
    assert len(task.client_data(_client(0))) == 89


def test_module_attr_that_is_missing_is_a_config_error(project: Path) -> None:
    # Prepare
    _write(project, "user_wine_attr", _WINE_TASK)

    # Execute / Assert
    with pytest.raises(ConfigError, match="module 'user_wine_attr' has no 'nothing'"):
        load_task(_config(project, "user_wine_attr:nothing"))


def test_module_without_load_data_serves_its_model_and_refuses_a_client(project: Path) -> None:
    # Prepare: a task for Flower nodes whose own train loads the data (the model only)
    _write(
        project, "user_no_data", "import torch\n\ndef model():\n    return torch.nn.Linear(2, 2)\n"
    )
    task = load_task(_config(project, "user_no_data"))

    # Execute / Assert: the model is there; a fedps client is told what is missing
    assert isinstance(task.create_model(), torch.nn.Linear)
    with pytest.raises(ConfigError, match=r"task 'user_no_data' has no load_data\(client\)"):
        task.client_data(ClientData(None))


def test_module_without_model_is_a_config_error_naming_it(project: Path) -> None:
    # Prepare
    _write(project, "user_no_model", "def load_data(client):\n    return [], []\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"task 'user_no_model' has no model\(\)"):
        load_task(_config(project, "user_no_model"))


def test_unknown_module_is_a_config_error_listing_the_registered_tasks(project: Path) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=r"no module 'user_absent' in .*digits"):
        load_task(_config(project, "user_absent"))


def test_a_missing_dependency_of_the_task_is_not_reported_as_a_missing_task(
    project: Path,
) -> None:
    # Prepare: the task module exists; what it imports does not
    _write(project, "user_deps", "import user_dep_absent\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"'user_deps': importing it failed: .*user_dep_absent"):
        load_task(_config(project, "user_deps"))


def test_a_missing_module_that_prefixes_the_task_name_is_its_dependency(project: Path) -> None:
    # Prepare: task module user_lib_task imports user_lib, which is absent
    _write(project, "user_lib_task", "import user_lib\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match="importing it failed: No module named 'user_lib'"):
        load_task(_config(project, "user_lib_task"))


def test_registered_task_object_is_found_by_name(project: Path) -> None:
    # Prepare
    task = Task(name="user-registered", model=lambda: torch.nn.Linear(2, 2), load_data=_pairs)
    register_task("user-registered", task)

    # Execute
    found = load_task(_config(project, "user-registered"))

    # Assert
    assert found is task
    assert "user-registered" in task_names()


def test_register_task_twice_is_a_value_error(project: Path) -> None:
    # Prepare
    task = Task(name="user-twice", model=lambda: torch.nn.Linear(2, 2), load_data=_pairs)
    register_task("user-twice", task)

    # Execute / Assert
    with pytest.raises(ValueError, match="'user-twice' is already registered"):
        register_task("user-twice", task)
    with pytest.raises(ValueError, match="already registered"):
        register_task("digits", task)


def test_entry_point_of_an_installed_distribution_is_a_task(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a distribution as pip installs it, its folder on the path
    site = project / "site"
    dist_info = site / "user_wine_task-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: user-wine-task\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text("[fedps.tasks]\nwine = user_wine_task:task\n")
    _write(site, "user_wine_task", _WINE_TASK)
    monkeypatch.syspath_prepend(str(site))

    # Execute
    entry_points = importlib.metadata.entry_points(group="fedps.tasks")
    task = load_task(load_config(None, task={"app": "wine"}))

    # Assert
    assert "wine" in entry_points.names
    assert "wine" in task_names()
    assert task.name == "wine"
    assert len(task.client_data(ClientData(path=None, index=0, num_clients=1))) == 178


def _pairs(client: ClientData) -> DataLike:
    return np.zeros((3, 2)), np.array([0, 1, 0])


@pytest.mark.parametrize(
    "data",
    [
        (np.arange(6.0).reshape(3, 2), np.array([0, 2, 1])),
        (torch.arange(6.0).reshape(3, 2), torch.tensor([0, 2, 1])),
        TensorDataset(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 2, 1])),
        ([[0, 1], [2, 3], [4, 5]], [0, 2, 1]),
    ],
    ids=["numpy", "tensors", "tensor-dataset", "lists"],
)
def test_to_dataset_takes_classification_data(data: DataLike) -> None:
    # Prepare / Execute
    dataset = to_dataset(data)

    # Assert
    assert dataset.x.dtype == np.float32 and dataset.x.shape == (3, 2)
    assert dataset.y.dtype == np.int64 and dataset.y.tolist() == [0, 2, 1]
    assert dataset.num_classes == 3
    assert not dataset.is_regression


def test_to_dataset_takes_real_targets_as_regression() -> None:
    # Prepare
    x, y = np.arange(4.0), np.array([0.5, 1.5, 2.5, 3.5])

    # Execute
    dataset = to_dataset((x, y))

    # Assert: one feature column; float32 targets; no classes
    assert dataset.x.shape == (4, 1)
    assert dataset.y.dtype == np.float32 and dataset.y.tolist() == y.tolist()
    assert dataset.num_classes == 0 and dataset.is_regression


def test_to_dataset_keeps_a_fedps_dataset() -> None:
    # Prepare
    data = Dataset(np.zeros((2, 2), np.float32), np.array([0, 1]), 2, "mine")

    # Execute / Assert
    assert to_dataset(data) is data


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ([1, 2, 3], "returned list"),
        ((np.zeros((3, 2)), np.zeros(3), np.zeros(3)), "returned tuple"),
        (TensorDataset(torch.zeros(2, 2)), "a TensorDataset of"),
        ((np.zeros((3, 2)), np.array([0, 1])), "3 feature rows and 2 targets"),
        ((np.zeros((0, 2)), np.zeros(0, np.int64)), "0 feature rows"),
        ((np.array([[0.0, np.nan]]), np.array([0])), "finite numbers"),
        ((np.array([["a", "b"]]), np.array([0])), "finite numbers"),
        ((np.zeros((2, 2)), np.array([0, -1])), "class labels must be 0, 1"),
        ((np.zeros((2, 2)), np.array(["x", "y"])), "integer labels or finite real"),
        ((np.zeros((2, 2)), np.array([0.5, np.inf])), "integer labels or finite real"),
        ((np.zeros((2, 2)), 3), "one target per row"),
        ((np.float32(1.0), np.array([0])), "one row per example"),
        ((np.zeros((2, 2)), np.zeros((2, 2), np.int64)), "one class label per row"),
    ],
)
def test_to_dataset_refuses_bad_data_naming_the_problem(data: object, error: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=rf"^mine: load_data: .*{error}"):
        to_dataset(data, "mine: load_data")  # type: ignore[arg-type]


def _linear(weight: list[list[float]], bias: list[float]) -> torch.nn.Linear:
    layer = torch.nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
        layer.bias.copy_(torch.tensor(bias))
    return layer


def test_evaluate_model_reports_loss_and_accuracy_by_default() -> None:
    # Prepare: the identity predicts the larger feature's column; two of three are right
    task = Task(name="c", model=lambda: torch.nn.Linear(2, 2), load_data=_pairs)
    data = to_dataset((np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), np.array([0, 1, 1])))
    model = _linear([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])

    # Execute
    values = evaluate_model(task, model, data)

    # Assert
    outputs = model(torch.from_numpy(data.x))
    expected = torch.nn.functional.cross_entropy(outputs, torch.from_numpy(data.y)).item()
    assert values == pytest.approx({"loss": expected, "accuracy": 2 / 3})


def test_evaluate_model_of_a_regression_task_uses_its_metrics() -> None:
    # Prepare: y = 2x predicted for targets 2 and 5: errors 0 and 1
    def mae(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"mae": float((outputs.reshape(targets.shape) - targets).abs().mean())}

    task = Task(name="r", model=lambda: torch.nn.Linear(1, 1), load_data=_pairs, metrics=mae)
    data = to_dataset((np.array([1.0, 2.0]), np.array([2.0, 5.0])))

    # Execute
    values = evaluate_model(task, _linear([[2.0]], [0.0]), data)

    # Assert: mean squared error is the default loss of real targets
    assert values == pytest.approx({"loss": 0.5, "mae": 0.5})


def test_an_error_in_the_user_s_load_data_is_one_config_error_naming_the_call() -> None:
    # Prepare: a loader that cannot find its file
    def load_data(client: ClientData) -> DataLike:
        raise FileNotFoundError(f"{client.path} not found")

    task = Task(name="mine", model=lambda: torch.nn.Linear(2, 2), load_data=load_data)
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"task 'mine': load_data\(nope.csv\) failed: File"):
        task.client_data(ClientData(Path("nope.csv")))


def test_real_labels_for_a_classifier_are_refused_with_the_fix() -> None:
    # Prepare: three class scores, but the labels were left as floats (np.loadtxt's default)
    task = Task(name="mine", model=lambda: torch.nn.Linear(4, 3), load_data=_pairs)
    data = to_dataset((np.zeros((6, 4)), np.array([0.0, 1.0, 2.0, 0.0, 1.0, 2.0])))
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"gives 3 values per example.*astype\(numpy.int64\)"):
        task.check_fit(task.create_model(), data)


def test_a_classifier_with_too_few_outputs_is_refused() -> None:
    # Prepare
    task = Task(name="mine", model=lambda: torch.nn.Linear(4, 2), load_data=_pairs)
    data = to_dataset((np.zeros((6, 4)), np.array([0, 1, 2, 0, 1, 2])))
    # Execute / Assert
    with pytest.raises(ConfigError, match="a score for each of 3 classes"):
        task.check_fit(task.create_model(), data)


@pytest.mark.parametrize(
    "config",
    [
        {"training": {"partition": "plug-in"}},
        {"training": {"staleness": "plug-in"}},
        {"training": {"server_optimizer": "plug-in"}},
        {"training": {"mode": "plug-in"}},
        {"privacy": {"level": "plug-in"}},
    ],
)
def test_a_plug_in_s_name_is_left_for_its_registry(config: dict[str, dict[str, object]]) -> None:
    # Execute: a name of a register_* function's registry is a valid configuration ...
    loaded = load_config(None, **config)
    # Assert: ... kept for the registry to resolve when the role that uses it starts
    ((section, values),) = config.items()
    ((field, value),) = values.items()
    assert getattr(getattr(loaded, section), field) == value


def test_a_registered_dataset_is_a_task(project: Path) -> None:
    # Prepare: a dataset registered after fedps was imported
    rows = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    labels = (rows[:, 0] > 0).astype(np.int64)
    split = Dataset(rows, labels, 2, "tiny")
    fedps.learning.datasets.register_dataset(f"tiny-{project.name}", lambda _dir: (split, split))
    config = load_config(
        None, training={"dataset": f"tiny-{project.name}", "model": "logreg", "clients": 2}
    )
    # Execute
    task = load_task(config)
    # Assert: its model fits, each client holds a partition, the operator the test split
    own = task.client_data(ClientData(None, index=1, num_clients=2))
    assert task.create_model()(torch.from_numpy(rows[:2])).shape == (2, 2)
    assert 0 < len(own) < 40
    assert task.eval_data() is split


def test_the_layers_passed_without_opacus_are_none_that_it_validates() -> None:
    # Prepare: Opacus's validators, one per layer type
    from opacus.validators import ModuleValidator

    # Execute
    validated = set(ModuleValidator.VALIDATORS)

    # Assert: none of the layers check_dp_trainable passes without asking Opacus
    assert not validated & set(_PLAIN_LAYERS)


@pytest.mark.parametrize(
    ("model", "error"),
    [
        (torch.nn.Sequential(torch.nn.Linear(4, 3)).eval(), "training mode"),
        (torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), "BatchNorm1d"),
        (torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.LSTM(2, 2)), "LSTM"),
    ],
)
def test_a_model_opacus_refuses_is_refused_beside_plain_layers(
    model: torch.nn.Module, error: str
) -> None:
    # Prepare: a plain model passes
    check_dp_trainable(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Linear(2, 3)), "ok")

    # Execute / Assert
    with pytest.raises(ConfigError, match=error):
        check_dp_trainable(model, "refused")
