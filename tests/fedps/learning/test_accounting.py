"""Tests for fedps.learning.accounting: known epsilon values, calibration that never overshoots."""

from __future__ import annotations

import warnings

import pytest
from opacus.accountants import RDPAccountant

from fedps.errors import ConfigError
from fedps.learning.accounting import calibrate_noise, epsilon, epsilon_of_history

DELTA = 1e-5


def test_opacus_rdp_known_value() -> None:
    # Prepare: sigma 1.5, sampling rate 0.04, 2250 steps (90 epochs at batch 4% of the data).
    accountant = RDPAccountant()
    accountant.history = [(1.5, 0.04, 2250)]

    # Execute
    ours = epsilon(1.5, 0.04, 2250, DELTA, "rdp")
    opacus = accountant.get_epsilon(delta=DELTA)

    # Assert: Opacus 1.6.0 gives 7.3291111714386545.
    assert round(ours, 3) == 7.329
    assert ours == opacus


@pytest.mark.parametrize(
    "history",
    [
        [(1.5, 0.1, 12)],
        [(0.8, 0.01, 500)],
        [(1.0, 1.0, 3)],
        [(2.0, 0.25, 40), (1.5, 0.1, 12), (2.0, 0.25, 7)],  # the noise changed, then back
        [(0.5, 0.04, 1), (0.5, 0.04, 900)],
    ],
)
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_rdp_epsilon_is_opacus_accountants_float(
    history: list[tuple[float, float, int]], delta: float
) -> None:
    # Prepare: Opacus's accountant on the same history (its orders, its conversion).
    accountant = RDPAccountant()
    accountant.history = list(history)

    # Execute: ours caches one step's RDP curve per (sigma, q) and scales it.
    ours = epsilon_of_history(history, delta, "rdp")
    again = epsilon_of_history(list(reversed(history)), delta, "rdp")  # cached curves, reused

    # Assert: the very same float, in any order of the entries.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's "optimal order is the smallest alpha"
        opacus = accountant.get_epsilon(delta=delta)
    assert ours == opacus
    assert again == pytest.approx(opacus, rel=1e-12)


def test_prv_accountant_is_selectable_and_close_to_rdp() -> None:
    # Prepare / Execute
    rdp = epsilon(1.5, 0.04, 2250, DELTA, "rdp")
    prv = epsilon(1.5, 0.04, 2250, DELTA, "prv")

    # Assert: PRV accounting is tighter than RDP's conversion, but in the same place
    # (Opacus 1.6.0: 6.779 against 7.329).
    assert 0.85 * rdp < prv <= rdp


@pytest.mark.parametrize("target", [0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize(("sample_rate", "steps"), [(0.04, 2250), (0.2, 30), (1.0, 10)])
def test_calibration_never_overshoots(target: float, sample_rate: float, steps: int) -> None:
    # Prepare / Execute
    sigma = calibrate_noise(target, DELTA, sample_rate, steps, "rdp")
    spent = epsilon(sigma, sample_rate, steps, DELTA, "rdp")

    # Assert: at most the target, and within 1% below it.
    assert spent <= target
    assert spent >= 0.99 * target


@pytest.mark.parametrize("target", [1.0, 8.0])
def test_calibration_with_prv_never_overshoots(target: float) -> None:
    # Prepare / Execute
    sigma = calibrate_noise(target, DELTA, 0.2, 30, "prv")
    spent = epsilon(sigma, 0.2, 30, DELTA, "prv")

    # Assert: PRV needs less noise than RDP for the same target.
    assert 0.99 * target <= spent <= target
    assert sigma < calibrate_noise(target, DELTA, 0.2, 30, "rdp")


def test_zero_steps_spend_nothing() -> None:
    # Prepare / Execute
    spent = [epsilon(1.0, 0.1, 0, DELTA), epsilon_of_history([], DELTA)]

    # Assert
    assert spent == [0.0, 0.0]


@pytest.mark.parametrize("name", ["moments", "RDP", ""])
def test_unknown_accountant_is_refused(name: str) -> None:
    # Prepare / Execute / Assert: a ConfigError, which is also a ValueError.
    with pytest.raises(ConfigError, match="unknown accountant"):
        epsilon(1.0, 0.1, 10, DELTA, name)
    with pytest.raises(ValueError, match="choose one of gdp, prv, rdp"):
        calibrate_noise(1.0, DELTA, 0.1, 10, name)


def test_unreachable_target_is_refused() -> None:
    # Prepare / Execute / Assert: no sigma up to 1e6 reaches epsilon 1e-6 over 10^6 steps.
    with pytest.raises(ConfigError, match="out of reach"):
        calibrate_noise(1e-6, DELTA, 1.0, 1_000_000)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1.0, 1.5, 0.1, 10), "delta"),
        ((1.0, DELTA, 0.0, 10), "sample_rate"),
        ((1.0, DELTA, 1.5, 10), "sample_rate"),
        ((1.0, DELTA, 0.1, 0), "steps"),
        ((0.0, DELTA, 0.1, 10), "target_epsilon"),
    ],
)
def test_bad_arguments_are_named(args: tuple[float, float, float, int], match: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=match):
        calibrate_noise(*args)
