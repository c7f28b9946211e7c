"""Flower's plain FedAvg with Opacus DP-SGD on a fedps job: ``fedps bench --against flower``.

The job is what a Flower user would write for the same training, run the way a Flower user
runs it: Flower's own ``FedAvg`` strategy (``flwr.serverapp.strategy``) in a ``ServerApp``,
a ``ClientApp`` on the message API, both executed by Flower's simulation runtime
(``flwr.simulation.run_simulation``, Ray). Only the job is fedps's: the configuration names
the model, the data and its split into partitions (the task's ``create_model``, ``client_data``
with fedps's partitioner, ``eval_data``), the local optimizer and the DP settings (noise
multiplier, clipping norm, batch size, local epochs, rounds), and the server evaluates each
round's model as fedps's coordinator does (:func:`fedps.learning.tasks.evaluate_model` on the
task's held-out split). The training is plain Opacus: a ``PrivacyEngine`` with Poisson
sampling and its own (torch) noise, its accountant's history kept in the node's
``Context.state`` across rounds (the ClientApp is built again for every message), each
client's epsilon reported and the largest one kept (FedAvg would average it). Opacus's
per-sample gradients by default, or, with ``--clipping ghost``, Opacus's ghost clipping as its
documentation shows it (``make_private(..., grad_sample_mode="ghost", criterion=...)`` and the
loss wrapper it returns): a second baseline, Flower with the same clipping as fedps's default.

A round's seconds run from the end of one server-side evaluation to the end of the next (the
training messages, the aggregation and the evaluation), as a fedps round runs from its
opening to its evaluated record. Bytes per parameter are those of the model each node sends
back (its ``ArrayRecord``), per parameter.

``python -m fedps.bench.flower_baseline CONFIG.toml RESULT.json [--clipping ghost]`` runs the
job of a fedps configuration file and writes :func:`run_flower_fedavg`'s result; ``fedps
bench --against flower`` starts it so, as a process group of its own that it ends
afterwards, Ray's processes included.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import DataLoader, TensorDataset

from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError
from fedps.learning.datasets import Dataset
from fedps.learning.tasks import ClientData, Task, evaluate_model, load_task
from fedps.startup import root_logging_kept

with root_logging_kept():  # Opacus configures the root logger when imported: not ours to keep
    from opacus import PrivacyEngine

__all__ = ["create_client_app", "create_server_app", "main", "run_flower_fedavg"]

_log = logging.getLogger("fedps")
_STATE_KEY = "dp-sgd"  # the node's accountant history in Context.state
_HISTORY_KEYS = ("sigma", "rate", "steps")  # (noise multiplier, sample rate, steps) each
_PARTITION_KEY = "partition-id"  # the node's partition, in Flower's simulation node config


@functools.cache
def _job(config_path: str) -> tuple[FedPSConfig, Task]:
    """The job of a configuration file, once per process (a Ray worker runs many nodes)."""
    config = load_config(Path(config_path))
    return config, load_task(config)


@functools.cache
def _partition(config_path: str, index: int) -> Dataset:
    """Node ``index``'s partition of the job's data (fedps's partitioner), once per process."""
    config, task = _job(config_path)
    t = config.training
    return task.client_data(ClientData(None, index=index, num_clients=t.clients, seed=t.seed))


def _noise_multiplier(config: FedPSConfig) -> float:
    """The job's noise multiplier (a fixed one: the comparison gives both systems the same).

    Raises
    ------
    ConfigError
        The job asks for a target epsilon instead.
    """
    sigma = config.privacy.noise_multiplier
    if sigma is None:
        raise ConfigError("the Flower baseline needs privacy.noise_multiplier, not a target")
    return sigma


def _history(context: Context) -> list[tuple[float, float, int]]:
    """The node's accountant history, from its ``Context.state`` (empty at first)."""
    record = context.state.config_records.get(_STATE_KEY)
    if record is None:
        return []
    sigmas, rates, steps = ([_number(v) for v in _list(record[k])] for k in _HISTORY_KEYS)
    return [(s, q, int(n)) for s, q, n in zip(sigmas, rates, steps, strict=True)]


def _list(value: object) -> list[object]:
    """A record's value that is a list."""
    if not isinstance(value, list):
        raise TypeError(f"a list expected in the node's state, got {type(value).__name__}")
    return list(value)


def _keep_history(context: Context, history: Sequence[tuple[float, float, int]]) -> None:
    sigmas = [float(s) for s, _, _ in history]
    rates = [float(q) for _, q, _ in history]
    steps = [int(n) for _, _, n in history]
    context.state.config_records[_STATE_KEY] = ConfigRecord(
        dict(zip(_HISTORY_KEYS, (sigmas, rates, steps), strict=True))
    )


def _criterion(task: Task, data: Dataset) -> torch.nn.Module:
    """The loss module Opacus's ghost clipping needs (it switches its ``reduction`` off).

    Raises
    ------
    ConfigError
        The task has a loss of its own, or regression targets.
    """
    if task.loss is not None or data.is_regression:
        raise ConfigError("the Flower ghost baseline trains classification with cross-entropy")
    return torch.nn.CrossEntropyLoss()


def _train(
    config_path: str, threads: int, clipping: str, message: Message, context: Context
) -> Message:
    """One node's round: DP-SGD with Opacus from the received model.

    Per-sample gradients, or ghost clipping (``clipping``). The model goes back with the
    node's example count and epsilon.
    """
    torch.set_num_threads(threads)
    config, task = _job(config_path)
    training, privacy = config.training, config.privacy
    data = _partition(config_path, int(context.node_config[_PARTITION_KEY]))
    model = task.create_model(training.seed)
    # create_model seeds torch's generator (every party builds the same initial model), and
    # plain Opacus draws its noise and its Poisson batches from that generator: without a
    # fresh seed every node would draw the same noise in every round.
    torch.seed()
    model.load_state_dict(message.content.array_records["arrays"].to_torch_state_dict())
    loader = DataLoader(
        TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y)),
        batch_size=max(1, min(training.batch_size, len(data.y))),
    )
    engine = PrivacyEngine(accountant=privacy.accountant)
    engine.accountant.history = _history(context)
    ghost = clipping == "ghost"
    criterion = _criterion(task, data) if ghost else None
    private = engine.make_private(
        module=model,
        optimizer=task.create_optimizer(model.parameters(), training),
        data_loader=loader,
        noise_multiplier=_noise_multiplier(config),
        max_grad_norm=privacy.max_grad_norm,
        poisson_sampling=True,
        **({"grad_sample_mode": "ghost", "criterion": criterion} if ghost else {}),
    )
    # ghost: (module, optimizer, the loss wrapper that runs both backward passes, loader)
    module, optimizer, private_loader = private[0], private[1], private[-1]
    loss_fn = private[2] if ghost else task.loss_fn(data.is_regression)
    module.train()
    for _ in range(training.local_epochs):
        for x, y in private_loader:
            optimizer.zero_grad()
            # Poisson sampling can draw an empty batch: a step all the same (noise only)
            loss = loss_fn(module(x), y) if len(y) else module(x).sum() * 0.0
            loss.backward()
            optimizer.step()
    _keep_history(context, engine.accountant.history)
    reply = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {
                    "num-examples": len(data.y),
                    "epsilon": float(engine.accountant.get_epsilon(privacy.delta)),
                }
            ),
        }
    )
    return Message(reply, reply_to=message)


def create_client_app(
    config_path: Path, *, threads: int = 1, clipping: str = "per_sample"
) -> ClientApp:
    """The Flower ``ClientApp`` of the job in ``config_path``.

    Each node trains its partition (its ``partition-id``) with Opacus DP-SGD on ``threads``
    torch threads, its per-sample gradients clipped as ``clipping`` says (``"per_sample"``
    or ``"ghost"``).
    """
    app = ClientApp()
    train = functools.partial(_train, str(config_path), max(1, threads), clipping)

    @app.train()
    def node_train(message: Message, context: Context) -> Message:
        return train(message, context)

    return app


def _aggregate_train(replies: list[RecordDict], weighting: str) -> MetricRecord:
    """What the round's replies say.

    The largest epsilon (FedAvg would average it), the examples, the replies and the bytes of
    the models they sent back.
    """
    sent = sum(len(a.data) for r in replies for a in r.array_records["arrays"].values())
    metrics = [r.metric_records["metrics"] for r in replies]
    return MetricRecord(
        {
            "epsilon": max(_number(m["epsilon"]) for m in metrics),
            weighting: sum(_number(m[weighting]) for m in metrics),
            "replies": len(replies),
            "bytes-up": sent,
        }
    )


def _number(value: object) -> float:
    """A metric that is one number."""
    if not isinstance(value, int | float):
        raise TypeError(f"a metric of one number expected, got {type(value).__name__}")
    return float(value)


def create_server_app(config_path: Path, result: dict[str, Any]) -> ServerApp:
    """The Flower ``ServerApp`` of the job in ``config_path``.

    Flower's ``FedAvg`` over every node for ``training.rounds`` rounds, the model evaluated on
    the held-out split after each; ``result`` is filled with what :func:`run_flower_fedavg`
    returns.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config, task = _job(str(config_path))
        t = config.training
        model = task.create_model(t.seed)
        held_out = task.eval_data()
        if held_out is None:
            raise ConfigError(f"task {task.name!r} has no held-out data to evaluate on")
        marks: list[float] = []

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            metrics: dict[str, MetricRecordValues] = {**evaluate_model(task, model, held_out)}
            marks.append(time.perf_counter())
            return MetricRecord(metrics)

        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,  # the server evaluates, as fedps's coordinator does
            min_train_nodes=t.clients,
            min_available_nodes=t.clients,
            train_metrics_aggr_fn=_aggregate_train,
        )
        outcome = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=t.rounds,
            evaluate_fn=evaluate,
        )
        params = sum(p.numel() for p in model.parameters())
        result.update(_summary(outcome, marks, params))

    return app


def _summary(outcome: Any, marks: Sequence[float], params: int) -> dict[str, Any]:
    """The rounds of a finished run (Flower's ``Result``), timed by ``marks``."""
    train, evaluated = outcome.train_metrics_clientapp, outcome.evaluate_metrics_serverapp
    rounds = []
    for r in sorted(train):
        rounds.append(
            {
                "round": r,
                "seconds": marks[r] - marks[r - 1],
                "accuracy": float(evaluated[r].get("accuracy", math.nan)),
                "loss": float(evaluated[r]["loss"]),
                "max_epsilon": float(train[r]["epsilon"]),
                "clients": int(train[r]["replies"]),
                "bytes_up": int(train[r]["bytes-up"]),
            }
        )
    sent = sum(r["bytes_up"] for r in rounds)
    updates = sum(r["clients"] for r in rounds)
    steady = [r["seconds"] for r in rounds[1:]] or [r["seconds"] for r in rounds]
    return {
        "system": "flower",
        "num_params": params,
        "rounds": rounds,
        "round_seconds": [r["seconds"] for r in rounds],
        "median_round_s": statistics.median(steady) if steady else math.nan,
        "final_accuracy": rounds[-1]["accuracy"] if rounds else math.nan,
        "max_epsilon": max((r["max_epsilon"] for r in rounds), default=0.0),
        "bytes_per_param": sent / max(1, updates) / params,
    }


def run_flower_fedavg(
    config_path: Path, *, threads: int = 1, workers: int = 2, clipping: str = "per_sample"
) -> dict[str, Any]:
    """Run the job of ``config_path`` with Flower's plain FedAvg in its simulation runtime.

    ``workers`` Ray actors of one CPU each, ``threads`` torch threads per node, Opacus's
    per-sample gradients or its ghost clipping (``clipping``: ``"per_sample"``, ``"ghost"``).

    Returns
    -------
    dict
        ``{"system": "flower", "num_params", "rounds": [{"round", "seconds", "accuracy",
        "loss", "max_epsilon", "clients", "bytes_up"}], "round_seconds", "median_round_s"
        (rounds 2..R), "final_accuracy", "max_epsilon", "bytes_per_param"}``.

    Raises
    ------
    ConfigError
        The job has no fixed noise multiplier, or no held-out data.
    RuntimeError
        Not every round ran.
    """
    from fedps.bench.flower_bench import simulate  # starts Ray the way this repository does

    config, _ = _job(str(config_path))
    _noise_multiplier(config)
    result: dict[str, Any] = {}
    server_app = create_server_app(config_path, result)
    client_app = create_client_app(config_path, threads=threads, clipping=clipping)
    simulate(server_app, client_app, nodes=config.training.clients, workers=workers)
    if len(result.get("rounds", ())) != config.training.rounds:
        raise RuntimeError(
            f"Flower ran {len(result.get('rounds', ()))} of {config.training.rounds} rounds"
        )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job of a configuration file and write its result as JSON.

    ``python -m fedps.bench.flower_baseline CONFIG.toml RESULT.json [--threads N]
    [--workers N] [--clipping per_sample|ghost]``.
    """
    parser = argparse.ArgumentParser(prog="fedps.bench.flower_baseline")
    parser.add_argument("config", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clipping", choices=("per_sample", "ghost"), default="per_sample")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # offline: no telemetry events
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs, no warning
    result = run_flower_fedavg(
        args.config, threads=args.threads, workers=args.workers, clipping=args.clipping
    )
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # Run from the module by its name, not as __main__: Ray's workers unpickle the ClientApp's
    # functions by their module's name, which they can import.
    from fedps.bench import flower_baseline

    raise SystemExit(flower_baseline.main())
