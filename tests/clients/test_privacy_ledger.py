"""A client's privacy spend kept in step with its ledger (clients/privacy_ledger.py): recorded
before a round trains, resumed after a restart and across changed data, and counted for the
rounds a client-level client sat out. Real trainers, real state folders."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from clients.client_state import ClientState
from clients.dp_trainer import ClientLevelTrainer, Trainer, create_trainer
from clients.privacy_ledger import EXTERNAL_DATA, PrivacyLedger
from fedps.config import FedPSConfig, load_config
from fedps.learning.datasets import Dataset, load_dataset
from fedps.learning.models import create_model

DATA = "a" * 64  # a fingerprint's format
OTHER_DATA = "b" * 64


@pytest.fixture(scope="module")
def data() -> Dataset:
    train, _ = load_dataset("digits")
    return Dataset(train.x[:100], train.y[:100], train.num_classes, "digits/slice")


def _config(**privacy: object) -> FedPSConfig:
    training = {"rounds": 3, "batch_size": 20, "clients": 4, "cohort_size": 2, "min_quorum": 2}
    return load_config(None, training=training, privacy={"noise_multiplier": 1.0, **privacy})


def _trainer(data: Dataset, config: FedPSConfig) -> Trainer:
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    return create_trainer(model, data, training=config.training, privacy=config.privacy)


def _ledger(folder: Path, trainer: Trainer, config: FedPSConfig, data: str) -> PrivacyLedger:
    state = ClientState.open(folder, identity="client-0")
    return PrivacyLedger(state, trainer, data=data, privacy=config.privacy, name="edge-0")


def test_a_round_is_recorded_before_it_trains_and_resumed_after_a_restart(
    tmp_path: Path, data: Dataset
) -> None:
    # Prepare: a fresh ledger has nothing to resume
    config = _config()
    first = _ledger(tmp_path, _trainer(data, config), config, DATA)
    assert first.epsilon == 0.0

    # Execute: the round's spend recorded (as before training), then a restart
    first.record_next_round()
    recorded = first.recorded
    first.state.close()
    trainer = _trainer(data, config)
    second = _ledger(tmp_path, trainer, config, DATA)

    # Assert: what the round will spend, durable, and the restarted trainer resumes it
    assert recorded == first.trainer.spend_after_next_round() and recorded.epsilon > 0
    assert second.recorded == trainer.spend() == recorded
    assert second.state.spent(DATA, "example") is not None
    second.state.close()


def test_data_that_changed_counts_what_the_earlier_data_spent(
    tmp_path: Path, data: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a round spent on one data set
    config = _config()
    first = _ledger(tmp_path, _trainer(data, config), config, DATA)
    first.record_next_round()
    spent = first.epsilon
    first.state.close()

    # Execute: the client comes back with other data (a file that grew)
    with caplog.at_level(logging.WARNING, logger="fedps"):
        second = _ledger(tmp_path, _trainer(data, config), config, OTHER_DATA)

    # Assert: the budget does not start again from zero, and the client says why
    assert second.epsilon == pytest.approx(spent)
    assert "its data changed since it last trained" in caplog.text
    second.state.close()


def test_rounds_sat_out_count_at_client_level_only(tmp_path: Path, data: Dataset) -> None:
    # Prepare: an example-level and a client-level client, in memory
    example = _config()
    client = _config(level="client", clip_norm=0.5)
    per_example = PrivacyLedger(
        ClientState.in_memory("client-0"),
        _trainer(data, example),
        data=DATA,
        privacy=example.privacy,
        name="edge-0",
    )
    client_trainer = _trainer(data, client)
    assert isinstance(client_trainer, ClientLevelTrainer)
    per_client = PrivacyLedger(
        ClientState.in_memory("client-1"),
        client_trainer,
        data=EXTERNAL_DATA,
        privacy=client.privacy,
        name="edge-1",
    )
    client_trainer.set_run("run-1")

    # Execute: rounds 1 and 2 finished without either
    grew = [per_example.sit_out(2), per_client.sit_out(2), per_client.sit_out(2)]

    # Assert: only client level counts them (once), and records them in its ledger
    assert grew == [False, True, False]
    assert per_example.epsilon == 0.0 and per_example.state.spent(DATA, "example") is None
    entry = per_client.state.spent(EXTERNAL_DATA, "client")
    assert entry is not None and entry.spend == per_client.recorded
    assert per_client.recorded.history[-1][2] == 2 and per_client.epsilon > 0
