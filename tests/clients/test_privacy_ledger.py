"""A client's privacy spend kept in step with its ledger (clients/privacy_ledger.py): recorded
before a round trains, resumed after a restart and across changed data that shares rows (not
across data that shares none), and counted for the rounds a client-level client sat out. Real
trainers, real state folders."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from clients.client_state import ClientState, DataSource
from clients.dp_trainer import ClientLevelTrainer, PrivacySpend, Trainer, create_trainer
from clients.privacy_ledger import EXTERNAL_DATA, PrivacyLedger, largest
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


def _ledger(
    folder: Path, trainer: Trainer, config: FedPSConfig, data: DataSource | str
) -> PrivacyLedger:
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


def test_the_previous_versions_entry_for_the_same_data_is_resumed_and_taken_over(
    tmp_path: Path, data: Dataset
) -> None:
    # Prepare: a spend recorded under the previous version's fingerprint of the same data
    config = _config()
    source = DataSource.of(data)
    first = _ledger(tmp_path, _trainer(data, config), config, source.earlier)
    first.record_next_round()
    spent = first.recorded
    first.state.close()

    # Execute: the upgraded client on the same data, which then records a round
    second = _ledger(tmp_path, _trainer(data, config), config, source)
    resumed = second.recorded
    second.record_next_round()

    # Assert: nothing of the spend is lost, and the old entry is replaced by the new one
    assert resumed == spent
    assert second.state.spent(source.earlier, "example") is None
    entry = second.state.spent(source.fingerprint, "example")
    assert entry is not None and entry.epsilon > spent.epsilon
    second.state.close()


def test_data_that_shares_no_row_with_earlier_data_starts_from_zero(
    tmp_path: Path, data: Dataset
) -> None:
    # Prepare: a round spent on the first 50 rows
    config = _config()
    low, high = (Dataset(data.x[s], data.y[s], data.num_classes, "d") for s in _HALVES)
    first = _ledger(tmp_path, _trainer(low, config), config, DataSource.of(low))
    first.record_next_round()
    first.state.close()

    # Execute: the client comes back with the other 50
    second = _ledger(tmp_path, _trainer(high, config), config, DataSource.of(high))

    # Assert
    assert first.epsilon > 0 and second.epsilon == 0.0
    second.state.close()


_HALVES = (slice(0, 50), slice(50, 100))


def test_the_largest_spend_covers_each_one() -> None:
    # Prepare: one spend that covers another, and one that neither covers nor is covered by
    small = PrivacySpend(((1.0, 0.1, 10),), 1.0, "run-1")
    large = PrivacySpend(((1.0, 0.1, 10), (1.0, 0.2, 5), (1.0, 0.1, 5)), 2.0, "run-2")
    other = PrivacySpend(((2.0, 0.1, 40),), 1.5, "run-3")

    # Execute / Assert: the covering one as it is, with its run; else the largest stretches
    assert largest([small, large]) == (large.history, "run-2")
    assert largest([small, large, other]) == (((1.0, 0.1, 15), (1.0, 0.2, 5), (2.0, 0.1, 40)), "")
