"""Tests for fedps's Flower mod and the trainer it wraps the app's own ``train`` in: the update
is clipped and accounted at client level, only inside a round's training, and messages that
are not fedps's pass through to the app untouched."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.flower.fedps_mod import FedPSMod
from clients.flower.wrapped_trainer import WrappedTrainer
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError
from fedps.sharding.blocks import flatten_model
from server.flower.in_process_grid import InProcessGrid


def _config(**privacy: object) -> FedPSConfig:
    return load_config(
        None,
        training={"clients": 4, "rounds": 3},
        privacy={"level": "client", "noise_multiplier": 0.0, "clip_norm": 0.5, **privacy},
    )


def _trainer(config: FedPSConfig) -> WrappedTrainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return WrappedTrainer(model, training=config.training, privacy=config.privacy)


def _shift(model: torch.nn.Module) -> None:
    """A stand-in for the app's training: every parameter moves by +1."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def test_the_update_of_a_wrapped_training_is_clipped_and_counted() -> None:
    # Prepare: no noise, so the released update is exactly the clipped one.
    config = _config()
    trainer = _trainer(config)
    start = flatten_model(trainer.model)
    trainer.set_run("run-1")
    trainer.set_round(1)

    # Execute
    with trainer.training_with(_shift):
        update = trainer.train_round(start)

    # Assert: the whole update (all ones, norm sqrt(8)) scaled down to norm 0.5, one round
    # accounted at q = 1.
    np.testing.assert_allclose(update, np.full(start.size, 0.5 / np.sqrt(start.size)), rtol=1e-6)
    assert trainer.history() == ((0.0, 1.0, 1),)


def test_a_wrapped_trainer_trains_only_inside_a_round() -> None:
    # Prepare
    trainer = _trainer(_config())
    start = flatten_model(trainer.model)
    with trainer.training_with(_shift):
        trainer.train_round(start)

    # Execute / Assert: the round's training is gone once its block ends.
    with pytest.raises(RuntimeError, match="training_with"):
        trainer.train_round(start)


def test_a_wrapped_train_refuses_example_level_dp() -> None:
    # Prepare
    config = load_config(None, privacy={"level": "example"})

    # Execute / Assert
    with pytest.raises(ConfigError, match=r'privacy\.level = "client"'):
        _trainer(config)


def test_a_message_that_is_not_fedps_passes_to_the_app_untouched() -> None:
    # Prepare: the app with the mod on one node; a plain Flower train message, as a FedAvg
    # strategy sends it.
    app = ClientApp(mods=[FedPSMod(_config())])
    seen: list[float] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(cast(float, msg.content.config_records["config"]["lr"]))
        return Message(RecordDict({"metrics": MetricRecord({"done": 1})}), reply_to=msg)

    grid = InProcessGrid(app, 1, workers=1)
    (node,) = grid.get_node_ids()
    content = RecordDict({"config": ConfigRecord({"lr": 0.1})})

    # Execute
    try:
        (reply,) = grid.send_and_receive([grid.create_message(content, "train", node, "1")])
    finally:
        grid.close()

    # Assert: the app answered it, and the mod kept no fedps state for it.
    assert seen == [0.1]
    assert reply.content.metric_records["metrics"]["done"] == 1
