"""Cohort sampling: Poisson at the accountant's rate (client level), fixed size (example level),
from a CSPRNG unless the insecure reproducible setting is on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedps.config import FedPSConfig, load_config
from fedps.learning.accounting import client_level_noise
from server.coordinator.cohort_sampler import CohortSampler

pytestmark = pytest.mark.privacy

DRAWS = 20_000
LIVE = [f"client-{i}" for i in range(10)]  # 10 of the 20 provisioned clients are live


def _config(level: str, **privacy: object) -> FedPSConfig:
    return load_config(
        None,
        training={"clients": 20, "cohort_size": 6, "min_quorum": 2},
        privacy={"level": level, "noise_multiplier": 1.0, **privacy},
    )


def _draws(sampler: CohortSampler, count: int = DRAWS) -> np.ndarray:
    """A (count, live clients) matrix: whether each live client was drawn in each round."""
    cohorts = [sampler.draw(LIVE) for _ in range(count)]
    return np.array([[c in cohort for c in LIVE] for cohort in cohorts])


def test_client_level_cohorts_are_poisson_at_the_accountants_rate() -> None:
    # Prepare: q = 6 / 20 over the provisioned clients, whatever is live
    config = _config("client")
    rate = client_level_noise(config.training, config.privacy).sample_rate
    sampler = CohortSampler(config.training, config.privacy)

    # Execute
    drawn = _draws(sampler)

    # Assert: the rate is q for each client (not 6 of the 10 live, 0.6) ...
    assert rate == sampler.rate == pytest.approx(0.3)
    per_client_sd = math.sqrt(rate * (1 - rate) / DRAWS)
    assert np.all(np.abs(drawn.mean(axis=0) - rate) < 5 * per_client_sd)
    # ... and clients are drawn independently: cohort sizes are Binomial(10, q), empty
    # cohorts included (the coordinator skips those rounds), and pairs are uncorrelated.
    sizes = drawn.sum(axis=1)
    n = len(LIVE)
    assert abs(sizes.mean() - n * rate) < 5 * math.sqrt(n * rate * (1 - rate) / DRAWS)
    assert sizes.var() == pytest.approx(n * rate * (1 - rate), rel=0.05)
    empty = (1 - rate) ** n
    assert abs((sizes == 0).mean() - empty) < 5 * math.sqrt(empty * (1 - empty) / DRAWS)
    correlation = np.corrcoef(drawn.T)[np.triu_indices(n, 1)]
    assert np.abs(correlation).max() < 5 / math.sqrt(DRAWS)


def test_client_level_cohort_of_everyone_takes_every_live_client() -> None:
    config = load_config(
        None,
        training={"clients": 20, "cohort_size": 0},
        privacy={"level": "client", "noise_multiplier": 1.0},
    )
    sampler = CohortSampler(config.training, config.privacy)

    assert sampler.rate == 1.0
    assert all(sampler.draw(LIVE) == frozenset(LIVE) for _ in range(100))


def test_example_level_cohorts_have_the_configured_size() -> None:
    config = _config("example")
    sampler = CohortSampler(config.training, config.privacy)

    drawn = _draws(sampler, 5_000)

    assert set(drawn.sum(axis=1)) == {6}
    assert np.all(np.abs(drawn.mean(axis=0) - 0.6) < 5 * math.sqrt(0.24 / 5_000))


def test_cohorts_come_from_a_csprng_unless_insecure_reproducible_is_set() -> None:
    # Prepare: two coordinators of one configuration
    secure = _config("client")
    insecure = _config("client", insecure_reproducible=True)
    a, b = (CohortSampler(secure.training, secure.privacy) for _ in range(2))
    c, d = (CohortSampler(insecure.training, insecure.privacy) for _ in range(2))

    # Execute
    samplers = {"a": a, "b": b, "c": c, "d": d}
    cohorts = {name: [s.draw(LIVE) for _ in range(50)] for name, s in samplers.items()}

    # Assert: the configuration (and its seed) does not give the cohorts away ...
    assert cohorts["a"] != cohorts["b"]
    # ... except behind the insecure setting, which regenerates them from training.seed.
    assert cohorts["c"] == cohorts["d"]


def test_client_level_config_sizes_the_ckks_headroom_for_poisson_overshoot() -> None:
    # 100 of 1000 on average, up to 166 (mean + 6 sqrt(mean) + 6) in a round
    training = {"clients": 1000, "cohort_size": 100}
    with pytest.raises(ValueError, match=r"he\.max_clients"):
        load_config(None, training=training, privacy={"level": "client"})
    load_config(None, training=training, privacy={"level": "client"}, he={"max_clients": 166})
    load_config(None, training=training, he={"max_clients": 100})  # example level: fixed size
