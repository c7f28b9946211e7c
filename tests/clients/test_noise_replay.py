"""The DP-SGD noise cannot be regenerated: replaying a client's training from everything but
its randomness (the whole configuration, its data, the model it started from) leaves the
released update's noise in place.

The audit's attack: the noise used to be seeded from ``training.seed`` and the client's index,
so whoever held the configuration (the key holder does) replayed the training with the same
seed and subtracted the noise, recovering the clipped-gradient sum to 6e-6 against a noise std
of 4.7. Here one round is one DP-SGD step over the whole partition (sample rate 1, so Poisson
sampling adds no randomness of its own) and the released update is
``-lr * (clipped sum + N(0, (sigma C)^2)) / n``: replays isolate the noise exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from clients.client_setup import client_partition
from clients.dp_trainer import DPTrainer
from fedps.config import FedPSConfig, load_config
from fedps.learning.models import create_model
from fedps.sharding.blocks import flatten_model

pytestmark = pytest.mark.privacy

SIGMA = 1.0
CLIP = 1.0
LR = 0.5
INDEX = 0


def _config(*, insecure: bool, sigma: float = SIGMA) -> FedPSConfig:
    return load_config(
        None,
        training={"rounds": 1, "clients": 4, "batch_size": 10_000, "lr": LR, "seed": 3},
        privacy={
            "noise_multiplier": sigma,
            "max_grad_norm": CLIP,
            "insecure_reproducible": insecure,
        },
    )


def _released(config: FedPSConfig, start: np.ndarray) -> np.ndarray:
    """One round of client INDEX's DP-SGD from ``start``, as its trainer releases it (the
    edge client seeds its trainer the same way)."""
    data = client_partition(config, INDEX)
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    seed = config.training.seed * 1000 + INDEX + 1
    trainer = DPTrainer(model, data, training=config.training, privacy=config.privacy, seed=seed)
    assert trainer.steps_per_round == 1 and trainer.sample_rate == 1.0
    return trainer.train_round(start)


@pytest.fixture(scope="module")
def start() -> np.ndarray:
    config = _config(insecure=False)
    data = client_partition(config, INDEX)
    model = create_model("mlp", num_features=data.num_features, num_classes=data.num_classes)
    return flatten_model(model)


def _noise_std(config: FedPSConfig) -> float:
    """The std of the noise in one released update: lr * sigma * C / n."""
    examples = len(client_partition(config, INDEX).y)
    return LR * SIGMA * CLIP / examples


def test_secure_noise_differs_between_runs_and_survives_a_replay(start: np.ndarray) -> None:
    # Prepare: the configuration a curious key holder holds, the data it would need
    config = _config(insecure=False)
    std = _noise_std(config)

    # Execute: the client runs twice; the attacker replays with the seed from the
    # configuration, and without noise
    first = _released(config, start)
    second = _released(config, start)
    seeded_replay = _released(_config(insecure=True), start)
    noiseless = _released(_config(insecure=False, sigma=0.0), start)

    # Assert: two runs, different noise (their difference has the spread of two noises) ...
    tolerance = 5 / np.sqrt(2 * start.size)  # 5 standard errors of a sample std
    assert not np.array_equal(first, second)
    assert np.std(first - second) / (np.sqrt(2) * std) == pytest.approx(1, abs=tolerance)
    # ... the noise-free replay leaves exactly the noise: nothing of it is predictable ...
    assert np.std(first - noiseless) / std == pytest.approx(1, abs=tolerance)
    assert abs(np.mean(first - noiseless)) < 5 * std / np.sqrt(start.size)
    # ... and replaying with the configured seed removes nothing (it adds a second noise).
    assert np.std(first - seeded_replay) / (np.sqrt(2) * std) == pytest.approx(1, abs=tolerance)


def test_insecure_reproducible_noise_is_removed_by_the_replay(start: np.ndarray) -> None:
    """The contrast (what the default used to be): with the seeded mode, the same replay
    takes the noise away entirely."""
    # Prepare
    config = _config(insecure=True)

    # Execute
    released = _released(config, start)
    replay = _released(config, start)

    # Assert: the residual is float rounding, orders of magnitude below the noise
    assert np.max(np.abs(released - replay)) < 1e-3 * _noise_std(config)
