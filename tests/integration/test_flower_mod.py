"""A Flower app's own ``train``, wrapped by fedps's mod, trains under encryption.

The ClientApp below is what a Flower user writes: a small torch model, its own data (its
partition of scikit-learn's digits), its own loss, optimizer and loop, replying with the
trained arrays. :class:`clients.flower.fedps_mod.FedPSMod` in its ``mods`` turns every round
into a fedps round: client-level DP on the update, CKKS encryption, commitments at the real
key holder and pushes to two real shards on loopback, and
:class:`server.flower.flower_strategy.FlowerStrategy` has the key holder decrypt and apply the
aggregate. Flower's own ``Strategy.start`` loop drives the rounds, over an
:class:`server.flower.in_process_grid.InProcessGrid` (the nodes run on threads) and in
Flower's simulation runtime (a ``ServerApp``, the nodes in Ray actors).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from sklearn.datasets import load_digits

from clients.flower.fedps_mod import FedPSMod
from fedps.bench.flower_bench import simulate
from fedps.config import FedPSConfig
from fedps.learning.tasks import Task, register_task, task_names
from server.flower.flower_strategy import FlowerStrategy
from server.flower.in_process_grid import InProcessGrid
from tests.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

ROUNDS = 4
NODES = 3
TASK = "flower-mod-digits"


# ---------------------------------------------------------------- the user's own code
def user_model() -> torch.nn.Module:
    """The app's model: a small MLP on 8x8 digits."""
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def user_data(partition: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The app's own data: every ``num_partitions``-th example of the training split."""
    x, y = _digits(train=True)
    return x[partition::num_partitions], y[partition::num_partitions]


def _digits(*, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1]; the first 1,400 examples train, the rest are held out."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    return (x[:1400], y[:1400]) if train else (x[1400:], y[1400:])


def accuracy(model: torch.nn.Module) -> float:
    """The model's accuracy on the held-out digits."""
    x, y = _digits(train=False)
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def user_client_app(config: FedPSConfig, calls: list[int] | None = None) -> ClientApp:
    """The user's ClientApp, with fedps's mod added (``calls``, where the nodes run in this
    process, records each node's train; Flower's simulation pickles the app to its actors)."""
    app = ClientApp(mods=[FedPSMod(config)])
    lock = threading.Lock() if calls is not None else None

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = user_model()
        model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
        partition = cast(int, context.node_config["partition-id"])
        x, y = user_data(partition, cast(int, context.node_config["num-partitions"]))
        lr = cast(float, msg.content.config_records["config"]["lr"])
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(partition)
        model.train()
        for _ in range(3):
            order = torch.randperm(len(y), generator=generator)
            for start in range(0, len(y), 32):
                batch = order[start : start + 32]
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
                optimizer.step()
        if calls is not None and lock is not None:
            with lock:
                calls.append(partition)
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": len(y)}),
            }
        )
        return Message(content, reply_to=msg)

    return app


# ---------------------------------------------------------------- fedps's side
if TASK not in task_names():
    # The model the key holder and the strategy hold, and the strategy's held-out data (no
    # load_data: the app's own train loads each node's data).
    register_task(
        TASK, Task(name=TASK, model=user_model, load_eval_data=lambda: _digits(train=False))
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A real key holder (CKKS) and two shards on loopback, for client-level DP."""
    cluster = start_cluster(
        tmp_path,
        coordinator=False,  # the Flower strategy plays its part
        task={"app": TASK},
        training={
            "rounds": ROUNDS,
            "clients": NODES,
            "min_quorum": NODES,
            "deadline_s": 30.0,
            "eval_every": ROUNDS,
        },
        # Client-level DP (the whole update clipped and noised). A small noise multiplier:
        # three clients cannot hide one another at a useful epsilon; this test checks the
        # mechanism and that the model still learns through it.
        privacy={"level": "client", "noise_multiplier": 0.05, "clip_norm": 2.0},
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_wrapped_user_train_learns_through_the_encrypted_rounds(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Prepare: the user's app with the fedps mod, the fedps strategy, three virtual nodes.
    calls: list[int] = []
    strategy = FlowerStrategy(cluster.config, state_dir=tmp_path / "flower")
    initial = user_model()
    initial.load_state_dict(strategy.initial_arrays().to_torch_state_dict())
    grid = InProcessGrid(user_client_app(cluster.config, calls), NODES, workers=2)

    # Execute: Flower's own strategy loop.
    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=strategy.initial_arrays(),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    finally:
        grid.close()

    # Assert: every node ran its own train each round, and the key holder applied exactly
    # the rounds, each with every node's update.
    assert sorted(calls) == sorted(list(range(NODES)) * ROUNDS)
    _assert_learned(cluster, strategy, result, initial)


def _assert_learned(
    cluster: Cluster, strategy: FlowerStrategy, result: Result, initial: torch.nn.Module
) -> None:
    """The key holder applied every round with every node's update, Flower's result is the
    model it published, and that model learned."""
    assert cluster.keyholder.version == ROUNDS
    history = strategy.coordinator.history
    assert [(r.round, r.contributors, r.abandoned) for r in history] == [
        (r, NODES, False) for r in range(1, ROUNDS + 1)
    ]
    # The model Flower returns is the one the key holder published, and it learned.
    final = user_model()
    final.load_state_dict(result.arrays.to_torch_state_dict())
    applied = cluster.keyholder.params
    assert applied is not None
    returned = np.concatenate([p.detach().numpy().ravel() for p in final.parameters()])
    np.testing.assert_allclose(returned, applied, rtol=0, atol=1e-6)
    assert accuracy(initial) < 0.25
    assert accuracy(final) > 0.6
    metrics = result.train_metrics_clientapp[ROUNDS]
    assert cast(float, metrics["accuracy"]) > 0.6
    assert 0 < cast(float, metrics["max-epsilon"]) < float("inf")


@pytest.mark.slow
@pytest.mark.usefixtures("one_ray_node")
def test_the_wrapped_app_trains_in_flowers_simulation_runtime(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the same ClientApp, and the strategy in a ServerApp, as a Flower user runs them
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")  # offline: no telemetry events
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs; no Ray warning
    strategy = FlowerStrategy(cluster.config, state_dir=tmp_path / "flower")
    initial = user_model()
    initial.load_state_dict(strategy.initial_arrays().to_torch_state_dict())
    results: list[Result] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        results.append(
            strategy.start(
                grid=grid,
                initial_arrays=strategy.initial_arrays(),
                num_rounds=ROUNDS,
                train_config=ConfigRecord({"lr": 0.1}),
            )
        )

    # Execute: Flower's simulation runtime (the nodes in Ray actors)
    simulate(server_app, user_client_app(cluster.config), nodes=NODES, workers=2)

    # Assert
    (result,) = results
    _assert_learned(cluster, strategy, result, initial)
