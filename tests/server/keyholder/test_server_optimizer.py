"""Tests for server.keyholder.server_optimizer: known-value steps of FedAvg, FedAvgM and FedAdam."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedps.errors import ConfigError
from server.keyholder.server_optimizer import FedAdam, FedAvg, FedAvgM, create_server_optimizer

_vectors = arrays(np.float64, 5, elements=st.floats(-1e3, 1e3))


def test_fedavg_known_step() -> None:
    # Prepare
    opt = create_server_optimizer("fedavg", lr=0.5)
    params = np.array([1.0, 2.0, -3.0])
    delta = np.array([2.0, -4.0, 0.5])

    # Execute
    out = opt.step(params, delta)

    # Assert
    assert isinstance(opt, FedAvg)
    np.testing.assert_allclose(out, [2.0, 0.0, -2.75])
    np.testing.assert_array_equal(params, [1.0, 2.0, -3.0])  # input untouched


@given(_vectors, _vectors)
def test_fedavg_with_unit_lr_adds_the_average_update(params: np.ndarray, delta: np.ndarray) -> None:
    # Prepare
    opt = create_server_optimizer("fedavg", lr=1.0)

    # Execute
    out = opt.step(params, delta)

    # Assert
    np.testing.assert_array_equal(out, params + delta)


def test_fedavgm_known_steps() -> None:
    # Prepare
    opt = create_server_optimizer("fedavgm", lr=2.0, momentum=0.5)
    x0 = np.array([0.0, 10.0])

    # Execute
    x1 = opt.step(x0, np.array([1.0, 0.0]))  # m = [1, 0]
    x2 = opt.step(x1, np.array([0.0, 1.0]))  # m = 0.5 * [1, 0] + [0, 1] = [0.5, 1]
    x3 = opt.step(x2, np.array([0.0, 0.0]))  # m = [0.25, 0.5]

    # Assert
    assert isinstance(opt, FedAvgM)
    np.testing.assert_allclose(x1, [2.0, 10.0])
    np.testing.assert_allclose(x2, [3.0, 12.0])
    np.testing.assert_allclose(x3, [3.5, 13.0])
    np.testing.assert_allclose(opt.state["m"], [0.25, 0.5])


def test_fedavgm_with_zero_momentum_is_fedavg() -> None:
    # Prepare
    momentum_free = create_server_optimizer("fedavgm", lr=0.3, momentum=0.0)
    plain = create_server_optimizer("fedavg", lr=0.3)
    rng = np.random.default_rng(0)
    x_m = x_p = rng.standard_normal(4)

    # Execute
    for _ in range(3):
        delta = rng.standard_normal(4)
        x_m, x_p = momentum_free.step(x_m, delta), plain.step(x_p, delta)

    # Assert
    np.testing.assert_allclose(x_m, x_p)


def test_fedadam_known_steps() -> None:
    # Prepare: beta1 = 0.9, beta2 = 0.99, tau = 1e-3 (the defaults).
    opt = create_server_optimizer("fedadam", lr=0.1)
    delta = np.array([1.0, -2.0])

    # Execute
    x1 = opt.step(np.zeros(2), delta)
    x2 = opt.step(x1, delta)

    # Assert
    # Step 1: m = 0.1 * delta = [0.1, -0.2]; v = 0.01 * delta**2 = [0.01, 0.04];
    # x1 = 0.1 * m / (sqrt(v) + 1e-3) = [0.01 / 0.101, -0.02 / 0.201].
    assert isinstance(opt, FedAdam)
    np.testing.assert_allclose(x1, [0.0990099009900990, -0.0995024875621891], rtol=1e-12)
    # Step 2: m = [0.19, -0.38]; v = [0.0199, 0.0796];
    # x2 = x1 + 0.1 * m / (sqrt(v) + 1e-3).
    np.testing.assert_allclose(opt.state["m"], [0.19, -0.38], rtol=1e-12)
    np.testing.assert_allclose(opt.state["v"], [0.0199, 0.0796], rtol=1e-12)
    np.testing.assert_allclose(
        x2 - x1, [0.019 / (0.0199**0.5 + 1e-3), -0.038 / (0.0796**0.5 + 1e-3)], rtol=1e-12
    )
    np.testing.assert_allclose(x2 - x1, [0.1337393757, -0.1342117281], rtol=1e-9)


def test_fedadam_step_is_bounded_by_lr() -> None:
    # Prepare: a huge pseudo-gradient moves each coordinate by at most about lr.
    opt = create_server_optimizer("fedadam", lr=0.01)

    # Execute
    out = opt.step(np.zeros(3), np.array([1e6, -1e6, 0.0]))

    # Assert
    assert np.all(np.abs(out) <= 0.01 * 0.1 / np.sqrt(0.01) + 1e-12)
    assert out[2] == 0.0


@pytest.mark.parametrize("name", ["sgd", "FedAvg", "", "fedprox"])
def test_unknown_name_raises_config_error(name: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match="unknown server optimizer"):
        create_server_optimizer(name, lr=1.0)


def test_masked_step_leaves_other_values_and_their_state_alone() -> None:
    # Prepare: momentum builds up on both values, then only the first may move
    opt = FedAvgM(lr=1.0, momentum=0.5)
    x1 = opt.step(np.zeros(2), np.array([1.0, 1.0]))  # m = [1, 1]
    # Execute
    x2 = opt.step(x1, np.array([0.0, 5.0]), where=np.array([True, False]))
    # Assert: value 0 moves by m = 0.5; value 1 keeps x and m although its delta was 5
    assert np.allclose(x2, [1.5, 1.0])
    assert np.allclose(opt.state["m"], [0.5, 1.0])
