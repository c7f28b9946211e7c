"""Tests for clients.dp_trainer: one privacy accountant per run, a budget never overshot, and
client-level DP (DP-FedAvg): clipped, noised updates with uniform weights."""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.validators import ModuleValidator

from clients.client_state import LEDGER_FILE
from clients.dp_trainer import (
    ClientLevelTrainer,
    DPTrainer,
    Trainer,
    create_trainer,
)
from clients.edge_client import EdgeClient, PreparedPush
from clients.private_engine import PoissonBatches
from crypto.noise_pool import NoisePool
from crypto.randomness import SeededRandom
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError, PeerUnavailableError, PrivacyBudgetExceededError
from fedps.learning.accounting import calibrate_noise
from fedps.learning.datasets import Dataset, load_dataset
from fedps.learning.models import create_model
from fedps.learning.tasks import ClientData, Task
from fedps.rpc.coordinator_messages import (
    Assignment,
    AssignmentQuery,
    ClientRegistration,
    RegistrationReply,
    UpdateReport,
)
from fedps.sharding.blocks import BlockLayout, flatten_model

ROUNDS = 3
TARGET_EPSILON = 2.0
CLIP_NORM = 0.5


@pytest.fixture(scope="module")
def data() -> Dataset:
    train, _ = load_dataset("digits")
    return Dataset(train.x[:100], train.y[:100], train.num_classes, "digits/slice")


def _config(training: Mapping[str, object] | None = None, **privacy: object) -> FedPSConfig:
    base: dict[str, object] = {"rounds": ROUNDS, "batch_size": 20, "clients": 2, "min_quorum": 1}
    return load_config(None, training={**base, **(training or {})}, privacy=privacy)


def _trainer(data: Dataset, config: FedPSConfig) -> DPTrainer:
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    return DPTrainer(model, data, training=config.training, privacy=config.privacy, seed=0)


def _client_trainer(data: Dataset, config: FedPSConfig) -> ClientLevelTrainer:
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    trainer = create_trainer(model, data, training=config.training, privacy=config.privacy)
    assert isinstance(trainer, ClientLevelTrainer)
    return trainer


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


WAIT_S = 60.0  # a bound on waiting for the noise thread, never a measurement


def test_a_round_takes_the_noise_drawn_ahead_then_draws_on_demand(data: Dataset) -> None:
    # Prepare: the next round's noise drawn ahead
    trainer = _trainer(data, _config(noise_multiplier=1.0))
    plan = trainer.noise_of_next_round()
    trainer.draw_noise_ahead()
    assert trainer.noise_pool.wait(WAIT_S)
    params = flatten_model(trainer.model)

    # Execute: a round with it, a round without
    first = trainer.train_round(params)
    pool_after_first = (trainer.noise_pool.taken, trainer.noise_pool.drawn)
    trainer.train_round(params)
    trainer.close()

    # Assert: one array per step and trainable parameter, of its shape, at std sigma * C,
    # all taken from the pool, then all drawn on demand; the noise is timed
    params_per_step = [tuple(p.shape) for p in trainer.model.parameters()]
    assert [d.shape for d in plan] == params_per_step * trainer.steps_per_round
    assert {(d.std, d.dtype) for d in plan} == {(1.0 * 1.0, np.float32)}
    assert pool_after_first == (len(plan), 0)
    assert (trainer.noise_pool.taken, trainer.noise_pool.drawn) == (len(plan), len(plan))
    assert np.all(np.isfinite(first)) and "noise" in trainer.timer.seconds()


def test_client_level_noise_is_drawn_ahead_too(data: Dataset) -> None:
    # Prepare
    trainer = _client_trainer(data, _client_config(noise_multiplier=1.0))
    trainer.draw_noise_ahead()
    assert trainer.noise_pool.wait(WAIT_S)

    # Execute
    released = trainer.train_round(flatten_model(trainer.model))
    trainer.close()

    # Assert: the one share of the round, over the whole update
    (draw,) = trainer.noise_of_next_round()
    assert draw.shape == released.shape and draw.std == trainer.noise_std
    assert (trainer.noise_pool.taken, trainer.noise_pool.drawn) == (1, 0)


@pytest.mark.parametrize(
    "privacy",
    [{"insecure_reproducible": True}, {"noise_ahead_mib": 0}],
    ids=["seeded", "no-memory"],
)
def test_a_seeded_or_unbounded_trainer_draws_nothing_ahead(
    data: Dataset, privacy: dict[str, object]
) -> None:
    # Prepare: two trainers of the same configuration, one told to draw ahead
    config = _config(None, noise_multiplier=1.0, **privacy)
    ahead, on_demand = _trainer(data, config), _trainer(data, config)
    ahead.draw_noise_ahead()

    # Execute
    updates = [t.train_round(flatten_model(t.model)) for t in (ahead, on_demand)]
    ahead.close()

    # Assert: nothing was drawn ahead; seeded, the updates are the same
    assert (ahead.noise_pool.taken, ahead.noise_pool.drawn) == (0, len(ahead.noise_of_next_round()))
    if config.privacy.insecure_reproducible:
        np.testing.assert_array_equal(updates[0], updates[1])


def test_target_epsilon_is_calibrated_by_the_accounting_module(budgeted: BudgetedRun) -> None:
    # Prepare
    trainer = budgeted.trainer
    steps = ROUNDS * trainer.steps_per_round

    # Execute
    sigma = calibrate_noise(TARGET_EPSILON, 1e-5, trainer.sample_rate, steps, "rdp")

    # Assert: one calibration for the whole run, at the client's own sample rate.
    assert trainer.noise_multiplier == sigma
    assert trainer.sample_rate == 1 / trainer.steps_per_round  # one local epoch per round


def test_every_calibrated_round_fits_when_opacus_drops_a_batch() -> None:
    """93 examples in batches of 1: the plain loader has 93 batches, but Opacus's Poisson
    loader draws int(1 / (1 / 93)) = 92 per epoch and accounts at rate 1/92."""
    # Prepare
    train, _ = load_dataset("digits")
    data = Dataset(train.x[:93], train.y[:93], train.num_classes, "digits/93")
    config = _config({"batch_size": 1, "rounds": 1}, target_epsilon=TARGET_EPSILON)
    trainer = _trainer(data, config)

    # Execute
    allowed = trainer.can_train_round()
    predicted = trainer.epsilon_after_next_round()
    trainer.train_round(flatten_model(trainer.model))

    # Assert: the one round the noise was calibrated for is allowed, and lands on the target.
    assert trainer.steps_per_round == 92
    assert trainer.engine.accountant.history == [(trainer.noise_multiplier, 1 / 92, 92)]
    assert allowed
    assert trainer.epsilon() == predicted
    assert 0.99 * TARGET_EPSILON <= trainer.epsilon() <= TARGET_EPSILON


def _client_config(training: Mapping[str, object] | None = None, **privacy: object) -> FedPSConfig:
    return _config(training, level="client", clip_norm=CLIP_NORM, **privacy)


def test_client_level_update_is_clipped_before_noise(
    data: Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: record what reaches add_noise.
    trainer = _client_trainer(data, _client_config(target_epsilon=TARGET_EPSILON))
    params = flatten_model(trainer.model)
    before_noise: list[np.ndarray] = []
    add_noise = trainer.add_noise

    def recording(update: np.ndarray) -> np.ndarray:
        before_noise.append(update.copy())
        return add_noise(update)

    monkeypatch.setattr(trainer, "add_noise", recording)

    # Execute
    released = trainer.train_round(params)

    # Assert: local SGD moves further than the clip norm, so the clip is active.
    assert len(before_noise) == 1
    assert np.linalg.norm(before_noise[0]) == pytest.approx(CLIP_NORM, rel=1e-9)
    assert not np.allclose(released, before_noise[0])


def test_client_level_clip_scales_down_only(data: Dataset) -> None:
    # Prepare
    trainer = _client_trainer(data, _client_config(noise_multiplier=0.0))
    rng = np.random.default_rng(0)
    big, small = rng.normal(size=1000), rng.normal(size=1000)
    big *= 10 / np.linalg.norm(big)
    small *= 0.1 / np.linalg.norm(small)

    # Execute
    clipped_big, clipped_small = trainer.clip(big), trainer.clip(small)
    released = trainer.train_round(flatten_model(trainer.model))  # sigma 0: no noise

    # Assert: same direction, norm at most the clip norm; small updates unchanged.
    assert np.linalg.norm(clipped_big) == pytest.approx(CLIP_NORM)
    np.testing.assert_allclose(clipped_big * 10 / CLIP_NORM, big)
    np.testing.assert_array_equal(clipped_small, small)
    assert np.linalg.norm(released) <= CLIP_NORM * (1 + 1e-12)


@pytest.mark.parametrize(("clients", "cohort_size", "n"), [(4, 2, 2), (3, 0, 3), (5, 5, 5)])
def test_client_level_noise_is_the_cohort_share(
    data: Dataset, clients: int, cohort_size: int, n: int
) -> None:
    # Prepare
    training = {"clients": clients, "cohort_size": cohort_size, "min_quorum": 2}
    trainer = _client_trainer(data, _client_config(training, noise_multiplier=1.3))
    expected = 1.3 * CLIP_NORM / np.sqrt(n)

    # Execute
    noise = trainer.add_noise(np.zeros(1_000_000))

    # Assert: n such shares sum to std sigma * C (std estimate error ~0.07% here).
    assert trainer.cohort_size == n
    assert trainer.noise_std == pytest.approx(expected)
    assert noise.std() == pytest.approx(expected, rel=0.01)
    assert abs(noise.mean()) < 5 * expected / 1000
    assert np.sqrt(n) * noise.std() == pytest.approx(1.3 * CLIP_NORM, rel=0.01)


def test_client_level_epsilon_is_the_accountants_over_rounds(data: Dataset) -> None:
    # Prepare: 2 of 4 clients per round, so q = 0.5.
    training = {"clients": 4, "cohort_size": 2, "min_quorum": 2}
    trainer = _client_trainer(data, _client_config(training, target_epsilon=TARGET_EPSILON))
    params = flatten_model(trainer.model)

    # Execute
    for _ in range(ROUNDS):
        params = params + trainer.train_round(params)
    spent = trainer.epsilon()
    accountant = RDPAccountant()
    accountant.history = [(trainer.noise_multiplier, 0.5, ROUNDS)]

    # Assert: exactly the accountant's value, within budget, and the budget ends the run.
    assert trainer.sample_rate == 0.5
    assert spent == accountant.get_epsilon(delta=1e-5)
    assert 0.99 * TARGET_EPSILON <= spent <= TARGET_EPSILON
    assert not trainer.can_train_round()
    with pytest.raises(PrivacyBudgetExceededError, match="budget"):
        trainer.train_round(params)
    assert trainer.epsilon() == spent


def test_client_level_epsilon_counts_global_rounds(data: Dataset) -> None:
    # Prepare
    training = {"clients": 4, "cohort_size": 2, "min_quorum": 2, "rounds": 10}
    trainer = _client_trainer(data, _client_config(training, noise_multiplier=1.0))
    params = flatten_model(trainer.model)

    def accountant_epsilon(rounds: int) -> float:
        accountant = RDPAccountant()
        accountant.history = [(1.0, 0.5, rounds)]
        return float(accountant.get_epsilon(delta=1e-5))

    # Execute: first picked for round 3, then round 3 again (a retry counts once more).
    trainer.set_round(3)
    predicted = trainer.epsilon_after_next_round()
    trainer.train_round(params)
    after_round_3 = trainer.epsilon()
    trainer.set_round(3)
    predicted_again = trainer.epsilon_after_next_round()

    # Assert: rounds the client sat out count too (amplification by sampling needs them).
    assert predicted == after_round_3 == accountant_epsilon(3)
    assert predicted_again == accountant_epsilon(4)


def test_client_level_needs_cohorts() -> None:
    # Execute / Assert: the configuration itself refuses client level in async mode
    with pytest.raises(ConfigError, match="sync"):
        _client_config({"mode": "async", "buffer_size": 2}, noise_multiplier=1.0)


class _FixedParams:
    """Stands in for the shards: every pull returns the same model."""

    def __init__(self, vector: np.ndarray) -> None:
        self.vector = vector

    def pull(
        self, layout: object, *, min_version: int, verify: object, only: object = None
    ) -> tuple[np.ndarray, int]:
        return self.vector.copy(), min_version


class _RecordingUplink:
    """Stands in for the coordinator: keeps what the client tells it (an Uplink)."""

    def __init__(self) -> None:
        self.registrations: list[ClientRegistration] = []
        self.announced: list[float] = []  # epsilons sent in GetTask
        self.reports: list[tuple[int, bool]] = []  # (round, budget_exhausted)
        self.down = False  # every GetTask fails as an unreachable coordinator's

    def register(
        self, registration: ClientRegistration, *, retry_s: float | None = None
    ) -> RegistrationReply:
        self.registrations.append(registration)
        return RegistrationReply("client-1", "run", "", {}, 0, 0, 0)

    def get_task(self, query: AssignmentQuery, *, retry_s: float | None = None) -> Assignment:
        if self.down:
            raise PeerUnavailableError("get task: coordinator down")
        self.announced.append(query.epsilon)
        return Assignment("wait", 0, 0)

    def report_update(self, report: UpdateReport, *, retry_s: float | None = None) -> None:
        self.reports.append((report.round, report.budget_exhausted))

    def close(self) -> None:
        pass


class _OfflineClient(EdgeClient):
    """An edge client with no servers: pulls a fixed model, pushes nothing, and keeps what it
    would have told the coordinator (:attr:`sent`)."""

    sent: _RecordingUplink

    @classmethod
    def offline(cls, config: FedPSConfig, *, index: int, state_dir: Path) -> _OfflineClient:
        sent = _RecordingUplink()
        client = cls.open(config, index=index, state_dir=state_dir, uplink=sent)
        client.sent = sent
        session = client.session  # as if joined: no encryption, no key holder key
        session._params = _FixedParams(flatten_model(client.trainer.model))  # type: ignore[assignment]
        session._layout = BlockLayout(client.num_params, client.num_params)
        return client

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        return None

    def train(self, round_: int, weight_scale: float = 1.0) -> bool:
        """Run the client's round ``round_`` as if the coordinator asked for it."""
        return self.run_task(Assignment("train", round_, 0, weight_scale=weight_scale))


def _weight_after_one_round(
    config: FedPSConfig, index: int, weight_scale: float, state_root: Path
) -> float:
    """An edge client's aggregation weight after one round, with no servers."""
    client = _OfflineClient.offline(
        config, index=index, state_dir=Path(tempfile.mkdtemp(dir=state_root))
    )
    assert client.train(1, weight_scale)
    client.close()
    return client.weight


def test_weights_are_uniform_unless_examples_weighting_bounded_below(tmp_path: Path) -> None:
    # Prepare: two of 8 clients, and weight scales (the cohort's largest num_examples) above
    # both, one of them absurd (a client that declared a huge num_examples).
    training = {"clients": 8, "min_quorum": 2, "rounds": 2}
    privacy = {"noise_multiplier": 1.0}
    uniform = load_config(None, training=training, privacy=privacy)
    examples = load_config(
        None, training=training, privacy=privacy, security={"weighting": "examples"}
    )
    client = load_config(
        None,
        training=training,
        privacy={"level": "client", "noise_multiplier": 1.0},
        security={"weighting": "examples"},
    )

    # Execute
    uniform_weights = [_weight_after_one_round(uniform, i, 1000.0, tmp_path) for i in range(2)]
    example_weights = [_weight_after_one_round(examples, i, 1000.0, tmp_path) for i in range(2)]
    floored = _weight_after_one_round(examples, 0, 1e12, tmp_path)
    client_weights = [_weight_after_one_round(client, i, 1000.0, tmp_path) for i in range(2)]

    # Assert: uniform by default; by num_examples when asked, never below min_weight;
    # client level weighs every client 1.0.
    assert uniform_weights == [1.0, 1.0]
    assert all(0.1 <= w < 1 for w in example_weights)
    assert floored == 0.1
    assert client_weights == [1.0, 1.0]


def test_local_momentum_carries_across_rounds(data: Dataset) -> None:
    # Prepare: two trainers on the same data and noise, with and without local momentum
    plain = _trainer(data, _config(noise_multiplier=1.0))
    heavy = _trainer(data, _config({"momentum": 0.9}, noise_multiplier=1.0))
    params = flatten_model(plain.model)

    # Execute: two rounds each from the same start
    first = [t.train_round(params) for t in (plain, heavy)]
    second = [t.train_round(params) for t in (plain, heavy)]

    # Assert: the momentum trainer's steps differ, and its second round starts with the
    # velocity built in the first (Opacus wraps torch's SGD with its momentum), so it moves
    # further than the plain trainer from the same start
    assert heavy.optimizer.param_groups[0]["momentum"] == 0.9
    assert plain.optimizer.param_groups[0]["momentum"] == 0.0
    assert not np.allclose(first[0], first[1])
    assert np.linalg.norm(second[1]) > np.linalg.norm(second[0])


def test_spend_recorded_before_a_round_is_exactly_the_spend_after_it(data: Dataset) -> None:
    # Prepare: example and client level
    trainers: list[Trainer] = [
        _trainer(data, _config(noise_multiplier=1.0)),
        _client_trainer(data, _client_config(noise_multiplier=1.0)),
    ]

    # Execute: what a client records before each of two rounds, and what it then spent
    pairs = []
    for trainer in trainers:
        params = flatten_model(trainer.model)
        for round_ in (1, 2):
            trainer.set_round(round_)
            before = trainer.spend_after_next_round()
            params = params + trainer.train_round(params)
            pairs.append((before, trainer.spend()))

    # Assert: the same history (Opacus's merged entries included) and epsilon
    for before, after in pairs:
        assert before == after
        assert after.epsilon > 0


def test_a_restored_trainer_resumes_the_budget_and_refuses_past_it(data: Dataset) -> None:
    # Prepare: a client trained two of the three rounds its budget covers, then died
    config = _config(target_epsilon=TARGET_EPSILON)
    first = _trainer(data, config)
    params = flatten_model(first.model)
    for _ in range(2):
        params = params + first.train_round(params)

    # Execute: a new process's trainer continues from the recorded history
    second = _trainer(data, config)
    second.restore(first.history())
    resumed = second.epsilon()
    allowed = second.can_train_round()
    params = params + second.train_round(params)

    # Assert: it starts where the first stopped, trains the one round left, then refuses
    assert resumed == first.epsilon() > 0
    assert allowed
    steps = 3 * second.steps_per_round
    assert second.history() == ((second.noise_multiplier, second.sample_rate, steps),)
    assert second.epsilon() <= TARGET_EPSILON
    assert not second.can_train_round()
    with pytest.raises(PrivacyBudgetExceededError):
        second.train_round(params)


def test_client_level_rounds_are_counted_per_run(data: Dataset) -> None:
    # Prepare: two rounds of run "a"
    config = _client_config({"rounds": 10}, noise_multiplier=1.0)
    first = _client_trainer(data, config)
    first.set_run("a")
    params = flatten_model(first.model)
    for round_ in (1, 2):
        first.set_round(round_)
        params = params + first.train_round(params)
    spent = first.spend()
    entry = (first.noise_multiplier, first.sample_rate)

    # Execute: restored in the same run (a restart), and in a new run
    same_run = _client_trainer(data, config)
    same_run.restore(spent.history, run_id=spent.run_id)
    same_run.set_run("a")
    same_run.set_round(3)
    new_run = _client_trainer(data, config)
    new_run.restore(spent.history, run_id=spent.run_id)
    new_run.set_run("b")
    new_run.set_round(1)

    # Assert: the restart continues run a's count; a new run composes with it
    assert spent.history == ((*entry, 2),) and spent.run_id == "a"
    assert same_run.epsilon() == first.epsilon()
    assert same_run.history_after_next_round() == ((*entry, 3),)
    assert new_run.epsilon() == first.epsilon()
    assert new_run.history_after_next_round() == ((*entry, 2), (*entry, 1))
    assert new_run.epsilon_after_next_round() > first.epsilon()


def test_edge_client_records_the_round_before_it_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: watch the ledger file when training starts
    client = _OfflineClient.offline(
        _config(target_epsilon=TARGET_EPSILON), index=0, state_dir=tmp_path
    )
    train_round = client.trainer.train_round
    on_disk: list[list[list[float]]] = []

    def training(params: np.ndarray, *, only: np.ndarray | None = None) -> np.ndarray:
        ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
        on_disk.append(ledger["entries"][0]["history"])
        return train_round(params, only=only)

    monkeypatch.setattr(client.trainer, "train_round", training)

    # Execute
    assert client.train(1)

    # Assert: the round's whole spend was durable, and announced, before a step was taken
    after = client.trainer.spend()
    assert on_disk == [[list(e) for e in after.history]]
    assert client.sent.announced == [after.epsilon]
    assert client.recorded == after
    client.close()


def test_edge_client_draws_the_next_rounds_noise_and_close_ends_it(tmp_path: Path) -> None:
    # Prepare
    client = _OfflineClient.offline(_config(noise_multiplier=1.0), index=0, state_dir=tmp_path)
    pool = client.trainer.noise_pool
    others = _noise_threads()  # other clients' (tests that did not close theirs)

    # Execute: a round, then the wait for the next one, then the client closes
    assert client.train(1)
    assert pool.wait(WAIT_S)
    plan = client.trainer.noise_of_next_round()
    ready = [pool.ready(d) for d in set(plan)]
    threads = _noise_threads() - others
    client.close()

    # Assert: the whole next round was drawn ahead; no thread is left after close, nor noise
    assert sum(ready) == len(plan) and len(threads) == 1
    assert not _noise_threads() - others and pool.reserved_bytes == 0


def test_edge_client_draws_no_noise_after_the_runs_last_round(tmp_path: Path) -> None:
    # Prepare
    client = _OfflineClient.offline(_config(noise_multiplier=1.0), index=0, state_dir=tmp_path)

    # Execute
    assert client.train(ROUNDS)
    reserved = client.trainer.noise_pool.reserved_bytes
    client.close()

    # Assert
    assert reserved == 0


def _noise_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "fedps-noise-ahead"}


def test_a_round_the_coordinator_cannot_hear_of_is_recorded_once_and_not_trained(
    tmp_path: Path,
) -> None:
    # Prepare: the coordinator is unreachable when the client announces its spend
    client = _OfflineClient.offline(
        _config(target_epsilon=TARGET_EPSILON), index=0, state_dir=tmp_path
    )
    client.sent.down = True

    # Execute: asked twice for the round
    attempts = [client.train(1), client.train(1)]

    # Assert: nothing trained, and the ledger holds one round (an over-estimate by one at
    # most, never growing while nothing trains)
    assert attempts == [True, True]
    assert client.trainer.history() == ()
    assert client.state.spent(client.data_fingerprint, "example") is not None
    assert client.recorded == client.trainer.spend_after_next_round()
    client.close()


def test_restarted_edge_client_resumes_its_budget(tmp_path: Path) -> None:
    # Prepare: a client spends two of its three rounds, then its process ends
    config = _config(target_epsilon=TARGET_EPSILON)
    first = _OfflineClient.offline(config, index=1, state_dir=tmp_path)
    assert first.train(1) and first.train(2)
    spent = first.trainer.epsilon()
    key = first.signing_key
    first.close()

    # Execute: a new client on the same folder
    second = _OfflineClient.offline(config, index=1, state_dir=tmp_path)
    resumed = (second.recorded.epsilon, second.trainer.epsilon())
    trained = second.train(3)
    refused = not second.train(4)

    # Assert: same key and spend; one more round, then it refuses and says its budget is spent
    assert second.signing_key == key
    assert resumed == (spent, spent)
    assert trained and refused
    assert second.sent.reports[-1] == (4, True)
    assert spent < second.recorded.epsilon <= TARGET_EPSILON
    second.close()


def test_restarted_edge_client_registers_with_its_recorded_epsilon(tmp_path: Path) -> None:
    # Prepare: a client trained a round, then its process ended
    config = _config(target_epsilon=TARGET_EPSILON)
    first = _OfflineClient.offline(config, index=1, state_dir=tmp_path)
    assert first.train(1)
    spent = first.recorded.epsilon
    first.close()
    second = _OfflineClient.offline(config, index=1, state_dir=tmp_path)

    # Execute
    second.session.register(timeout_s=1.0)

    # Assert: the coordinator hears at once what the data has spent
    (request,) = second.sent.registrations
    assert request.epsilon == spent > 0
    assert request.delta == config.privacy.delta
    assert request.signing_key == first.signing_key
    second.close()


class _NoExamples(SeededRandom):
    """A source whose Poisson draws take no example: every batch is empty."""

    def bernoulli(self, count: int, rate: float) -> np.ndarray:
        return np.zeros(count, dtype=bool)


@pytest.mark.parametrize("clipping", ["ghost", "per_sample"])
def test_opacus_takes_its_noise_and_batches_from_the_source(data: Dataset, clipping: str) -> None:
    # Prepare: a trainer whose source never samples an example
    config = _config(noise_multiplier=1.0, clipping=clipping)
    trainer = _trainer(data, config)
    source = _NoExamples(1)
    trainer.source = trainer.engine.source = trainer.loader.batch_sampler.source = source
    trainer.noise_pool = trainer.engine.noise = trainer.optimizer.noise = NoisePool(source)
    start = flatten_model(trainer.model)

    # Execute: one round of empty batches
    update = trainer.train_round(start)

    # Assert: the loader runs the steps the accountant records, at its rate; each step of no
    # examples still moved the model by pure noise, and the accountant counted it
    assert isinstance(trainer.loader.batch_sampler, PoissonBatches)
    assert 1 / len(trainer.loader) == trainer.sample_rate
    assert trainer.engine.accountant.history == [
        (trainer.noise_multiplier, trainer.sample_rate, trainer.steps_per_round)
    ]
    assert np.count_nonzero(update) > 0.99 * update.size
    assert trainer.module.grad_accumulation_allowed is False  # Poisson: one pass per step


@pytest.mark.privacy
def test_ghost_and_per_sample_clipping_release_the_same_update(data: Dataset) -> None:
    # Prepare: two seeded trainers, the same Poisson batches and noise, clipped each way
    trainers = {
        clipping: _trainer(
            data, _config(noise_multiplier=1.0, insecure_reproducible=True, clipping=clipping)
        )
        for clipping in ("ghost", "per_sample")
    }
    start = flatten_model(trainers["ghost"].model)

    # Execute
    updates = {clipping: t.train_round(start) for clipping, t in trainers.items()}

    # Assert: the same update to float32 rounding, the same spend
    np.testing.assert_allclose(updates["ghost"], updates["per_sample"], rtol=1e-4, atol=1e-6)
    assert trainers["ghost"].history() == trainers["per_sample"].history()


@pytest.mark.privacy
def test_masked_training_trains_only_the_masks_coordinates(data: Dataset) -> None:
    # Prepare: three seeded trainers clipping per sample (the same batches and noise); a mask
    # of a fifth of the coordinates, and one of every coordinate
    def seeded() -> DPTrainer:
        config = _config(noise_multiplier=1.0, insecure_reproducible=True, clipping="per_sample")
        return _trainer(data, config)

    plain, masked, whole = seeded(), seeded(), seeded()
    start = flatten_model(plain.model)
    only = np.sort(np.random.default_rng(5).choice(start.size, start.size // 5, replace=False))

    # Execute
    unmasked = plain.train_round(start)
    sparse = masked.train_round(start, only=only)
    full = whole.train_round(start, only=np.arange(start.size))

    # Assert: the other coordinates stay as pulled (not even the noise lands there); the
    # mask's move, each example's gradient clipped on them alone, so not as unmasked training
    # moves them; a mask of every coordinate is plain DP-SGD; the spend is the same
    outside = np.setdiff1d(np.arange(start.size), only)
    assert not sparse[outside].any() and np.count_nonzero(sparse[only]) > 0.9 * only.size
    assert not np.allclose(sparse[only], unmasked[only], rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(full, unmasked, rtol=1e-5, atol=1e-7)
    assert masked.history() == plain.history() == whole.history()
    with pytest.raises(ConfigError, match="per-sample gradients"):
        _trainer(data, _config(noise_multiplier=1.0)).train_round(start, only=only)


def _normed_task(model: Callable[[], torch.nn.Module]) -> Task:
    """A task on 40 rows of digits whose model is ``model``."""

    def load_data(client: ClientData) -> Dataset:
        train, _ = load_dataset("digits")
        return Dataset(train.x[:40], train.y[:40], train.num_classes, "digits/40")

    return Task(name="normed", model=model, load_data=load_data)


def _batch_normed() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    )


def test_a_task_model_with_batchnorm_is_refused_at_client_start_with_the_fix(
    tmp_path: Path,
) -> None:
    # Prepare
    config = _config(noise_multiplier=1.0)

    # Execute / Assert: the layer is named, and ModuleValidator.fix as the way out
    with pytest.raises(ConfigError) as refused:
        EdgeClient.open(config, index=0, state_dir=tmp_path, task=_normed_task(_batch_normed))
    message = str(refused.value)
    assert "task 'normed'" in message
    assert "layer '1' (BatchNorm1d): BatchNorm cannot support training with" in message
    assert "ModuleValidator.fix(model)" in message


def test_the_fixed_task_model_trains(tmp_path: Path) -> None:
    # Prepare: the fix the refusal names
    config = _config(noise_multiplier=1.0)
    task = _normed_task(lambda: ModuleValidator.fix(_batch_normed()))

    # Execute
    client = EdgeClient.open(config, index=0, state_dir=tmp_path, task=task)
    params = flatten_model(client.trainer.model)
    update = client.trainer.train_round(params)
    client.close()

    # Assert
    assert any(isinstance(m, torch.nn.GroupNorm) for m in client.trainer.model.modules())
    assert np.all(np.isfinite(update)) and np.any(update != 0)
    assert client.trainer.epsilon() > 0
