"""Tests for clients.dp_trainer: one privacy accountant per run, and a budget never overshot."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from clients.dp_trainer import DPTrainer
from fedps.blocks import flatten_model
from fedps.config import FedPSConfig, load_config
from fedps.datasets import Dataset, load_dataset
from fedps.errors import PrivacyBudgetExceededError
from fedps.models import create_model

ROUNDS = 3
TARGET_EPSILON = 2.0


@pytest.fixture(scope="module")
def data() -> Dataset:
    train, _ = load_dataset("digits")
    return Dataset(train.x[:100], train.y[:100], train.num_classes, "digits/slice")


def _config(**privacy: object) -> FedPSConfig:
    return load_config(
        None,
        training={"rounds": ROUNDS, "batch_size": 20, "clients": 2, "min_quorum": 1},
        privacy=privacy,
    )


def _trainer(data: Dataset, config: FedPSConfig) -> DPTrainer:
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    return DPTrainer(model, data, training=config.training, privacy=config.privacy, seed=0)


@dataclass
class BudgetedRun:
    """A trainer with a target epsilon after all its rounds, and what it reported."""

    trainer: DPTrainer
    predicted: list[float]  # epsilon_after_next_round() before each round
    spent: list[float]  # epsilon() before the first round and after each round
    accountants: list[object]  # the accountant object after each round
    updates: list[np.ndarray]
    params: np.ndarray


@pytest.fixture(scope="module")
def budgeted(data: Dataset) -> BudgetedRun:
    trainer = _trainer(data, _config(target_epsilon=TARGET_EPSILON))
    params = flatten_model(trainer.model)
    run = BudgetedRun(trainer, [], [trainer.epsilon()], [], [], params)
    for _ in range(ROUNDS):
        run.predicted.append(trainer.epsilon_after_next_round())
        update = trainer.train_round(run.params)
        run.updates.append(update)
        run.params = run.params + update
        run.spent.append(trainer.epsilon())
        run.accountants.append(trainer.engine.accountant)
    return run


def test_epsilon_grows_monotonically_across_rounds(budgeted: BudgetedRun) -> None:
    # Prepare / Execute: the module fixture trained ROUNDS rounds.
    spent = budgeted.spent

    # Assert: starts at zero and strictly grows; one accountant for the whole run.
    assert spent[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(spent))
    assert all(acc is budgeted.trainer.engine.accountant for acc in budgeted.accountants)
    steps = sum(s for _, _, s in budgeted.trainer.engine.accountant.history)
    assert steps == ROUNDS * budgeted.trainer.steps_per_round


def test_epsilon_after_next_round_predicts_the_spend(budgeted: BudgetedRun) -> None:
    # Prepare / Execute
    pairs = list(zip(budgeted.predicted, budgeted.spent[1:], strict=True))

    # Assert
    assert len(pairs) == ROUNDS
    for predicted, spent in pairs:
        assert abs(predicted - spent) <= 1e-9


def test_budget_is_never_overshot(budgeted: BudgetedRun) -> None:
    # Prepare
    trainer = budgeted.trainer
    epsilon_before = trainer.epsilon()
    history_before = list(trainer.engine.accountant.history)

    # Execute
    allowed = trainer.can_train_round()
    with pytest.raises(PrivacyBudgetExceededError, match="budget"):
        trainer.train_round(budgeted.params)

    # Assert: the calibrated noise lets exactly ROUNDS rounds through, spending at most the
    # target, and the refused round spent nothing.
    assert trainer.budget == TARGET_EPSILON
    assert not allowed
    assert trainer.epsilon_after_next_round() > TARGET_EPSILON
    assert epsilon_before <= TARGET_EPSILON
    assert epsilon_before > 0.5 * TARGET_EPSILON  # the budget is actually used
    assert trainer.epsilon() == epsilon_before
    assert trainer.engine.accountant.history == history_before


def test_updates_are_finite_and_non_zero(budgeted: BudgetedRun) -> None:
    # Prepare
    size = budgeted.params.size

    # Execute / Assert
    for update in budgeted.updates:
        assert update.shape == (size,)
        assert np.all(np.isfinite(update))
        assert np.any(update != 0.0)


def test_noise_multiplier_mode_has_no_budget(data: Dataset) -> None:
    # Prepare
    config = _config(noise_multiplier=1.0)
    trainer = _trainer(data, config)
    params = flatten_model(trainer.model)

    # Execute: more rounds than configured are allowed without a budget.
    spent = []
    for _ in range(ROUNDS + 1):
        assert trainer.can_train_round()
        params = params + trainer.train_round(params)
        spent.append(trainer.epsilon())

    # Assert
    assert config.privacy.target_epsilon is None
    assert trainer.budget is None
    assert trainer.noise_multiplier == 1.0
    assert all(b > a for a, b in itertools.pairwise(spent))


def test_opacus_rdp_known_value() -> None:
    # Prepare: sigma 1.5, sampling rate 0.04, 2250 steps (90 epochs at batch 4% of the data).
    accountant = RDPAccountant()
    accountant.history = [(1.5, 0.04, 2250)]

    # Execute
    epsilon = accountant.get_epsilon(delta=1e-5)

    # Assert
    assert round(epsilon, 3) == 7.329
