"""A Flower node restarted mid-run resumes its privacy spend from its state folder.

Two nodes run :func:`clients.flower.flower_client.create_client_app` (DP-SGD) over an
:class:`server.flower.in_process_grid.InProcessGrid`, with a real key holder and two shards on
loopback and :class:`server.flower.flower_strategy.FlowerStrategy` driving the rounds. Before
round 2 each node is restarted as a SuperNode restart does it: a new ``ClientApp`` (no client
built in this process) and an empty ``Context.state``.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from clients.client_setup import client_partition
from clients.dp_trainer import DPTrainer, create_trainer
from clients.flower.flower_client import create_client_app, fedps_record
from fedps.config import FedPSConfig
from fedps.learning.accounting import epsilon_of_history
from fedps.learning.tasks import load_task
from fedps.rpc.flower_messages import TRAIN_STAGE, FlowerTask, stage_of
from server.flower.flower_strategy import FlowerStrategy
from server.flower.in_process_grid import InProcessGrid
from tests.conftest import start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.privacy]

ROUNDS = 2
NODES = 2
RESTART = 2  # the round before which every node restarts


def restarting_nodes(config: FedPSConfig, restarted: set[int]) -> ClientApp:
    """Each node's own fedps ClientApp, restarted before its ``train`` message of round
    ``RESTART`` (a new app, its ``Context.state`` emptied); ``restarted`` collects the nodes."""
    apps: dict[int, ClientApp] = {}
    outer = ClientApp()

    @outer.train()
    def train(message: Message, context: Context) -> Message:
        node = context.node_id
        record = fedps_record(message)
        if (
            record is not None
            and stage_of(record) == TRAIN_STAGE
            and FlowerTask.from_record(record).round == RESTART
            and node not in restarted
        ):
            restarted.add(node)
            apps.pop(node, None)
            context.state = RecordDict()
        app = apps.setdefault(node, create_client_app(config, cache_size=0))
        return app(message, context)

    return outer


def spent_on_every_round(config: FedPSConfig, index: int) -> float:
    """The epsilon of every DP-SGD step node ``index`` takes in ``ROUNDS`` rounds."""
    task = load_task(config)
    trainer = create_trainer(
        task.create_model(config.training.seed),
        client_partition(config, index, task=task),
        training=config.training,
        privacy=config.privacy,
        task=task,
    )
    assert isinstance(trainer, DPTrainer)
    steps = (trainer.noise_multiplier, trainer.sample_rate, ROUNDS * trainer.steps_per_round)
    return epsilon_of_history((steps,), config.privacy.delta, config.privacy.accountant)


def test_a_restarted_flower_node_resumes_its_spend(tmp_path: Path) -> None:
    # Prepare: key holder and shards on loopback, the strategy as coordinator, two nodes
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"rounds": ROUNDS, "clients": NODES, "min_quorum": NODES, "deadline_s": 30.0},
    )
    strategy = FlowerStrategy(cluster.config, state_dir=tmp_path / "flower")
    restarted: set[int] = set()
    grid = InProcessGrid(restarting_nodes(cluster.config, restarted), NODES, workers=2)

    # Execute: Flower's own strategy loop; every node restarts before round 2
    try:
        result = strategy.start(
            grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=ROUNDS
        )
    finally:
        grid.close()
        cluster.stop()

    # Assert: both rounds ran with both nodes, and the epsilon they report after the restart
    # is that of every step they took, before it too
    assert len(restarted) == NODES
    assert [r.contributors for r in strategy.coordinator.history] == [NODES] * ROUNDS
    reported = cast(float, result.train_metrics_clientapp[ROUNDS]["max-epsilon"])
    spent = max(spent_on_every_round(cluster.config, i) for i in range(NODES))
    first = cast(float, result.train_metrics_clientapp[1]["max-epsilon"])
    print(f"restarted node: reported {reported:.3f}, all steps {spent:.3f}, round 1 {first:.3f}")
    assert reported == pytest.approx(spent, rel=0.01)
