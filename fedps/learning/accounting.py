"""Privacy accounting: epsilon of the subsampled Gaussian mechanism, and noise calibration.

Shared by the clients, which account for their own training, and the key holder, which tops
up client-level noise. Both example-level DP-SGD (:class:`clients.dp_trainer.DPTrainer`) and
client-level DP-FedAvg (:class:`clients.dp_trainer.ClientLevelTrainer`) compose ``steps``
runs of the sampled Gaussian mechanism (noise multiplier sigma, Poisson sampling rate q). The
accountant is picked by name from Opacus's registry
(:func:`opacus.accountants.create_accountant`):

``"rdp"``
    Renyi DP (Mironov 2017; Mironov, Talwar and Zhang 2019), the default.
``"prv"``
    Privacy random variables (Gopi, Lee and Wutschitz 2021); tighter, slower. Opacus returns
    the upper end of its error bound.
``"gdp"``
    Gaussian DP through the central limit theorem (Dong, Roth and Su 2019); experimental, it
    can *underestimate* epsilon (Opacus warns, and so do we).

:func:`calibrate_noise` bisects for the smallest sigma whose epsilon is at most the target,
like Opacus's ``get_noise_multiplier``, but with a tolerance relative to the target, a bound on
the number of iterations, an exact step count (Opacus's ``epochs`` path truncates
``epochs / sample_rate``, which can drop a step) and the guarantee re-checked on the sigma it
returns: the epsilon of the returned sigma never exceeds the target.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedps.config import PrivacyConfig, TrainingConfig
from fedps.errors import ConfigError
from fedps.startup import root_logging_kept

__all__ = [
    "ACCOUNTANTS",
    "ClientLevelNoise",
    "calibrate_noise",
    "client_cohort",
    "client_level_noise",
    "epsilon",
    "epsilon_of_history",
    "merged_history",
]

_log = logging.getLogger("fedps")

ACCOUNTANTS = ("gdp", "prv", "rdp")
"""Accountant names :func:`epsilon` and :func:`calibrate_noise` accept."""

_MAX_SIGMA = 1e6
_MAX_BISECTIONS = 200

_History = Sequence[tuple[float, float, int]]


def _check_name(name: str) -> None:
    if name not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}")


@functools.cache
def _warn_gdp() -> None:
    _log.warning("the gdp accountant is experimental and can underestimate epsilon; prefer rdp")


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")


@functools.lru_cache(maxsize=256)
def _rdp_per_step(sigma: float, q: float) -> tuple[float, ...]:
    """The RDP of one sampled Gaussian step at each of Opacus's default orders.

    Opacus's RDP accountant computes these for every history entry and multiplies them by the
    entry's step count; they depend on sigma and q only, and are most of its cost (about 0.1 s
    for the 150 orders), so they are computed once per (sigma, q).
    """
    with root_logging_kept():
        from opacus.accountants.analysis import rdp

    orders = _rdp_orders()
    return tuple(
        float(v) for v in rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
    )


@functools.cache
def _rdp_orders() -> tuple[float, ...]:
    with root_logging_kept():
        from opacus.accountants import RDPAccountant

    return tuple(RDPAccountant.DEFAULT_ALPHAS)


def _rdp_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon of a non-empty history, as Opacus's RDP accountant computes it.

    The same sum of per-entry RDP curves and the same conversion
    (:func:`opacus.accountants.analysis.rdp.get_privacy_spent`), with each entry's curve taken
    as its step count times the cached curve of one step: Opacus's ``compute_rdp`` is that
    product, so the result is the same float (a test compares them).
    """
    import numpy as np

    with root_logging_kept():
        from opacus.accountants.analysis import rdp

    curves = [np.array(_rdp_per_step(sigma, q)) * steps for sigma, q, steps in history]
    eps, _ = rdp.get_privacy_spent(orders=list(_rdp_orders()), rdp=sum(curves), delta=delta)
    return float(eps)


def _compute(history: tuple[tuple[float, float, int], ...], delta: float, name: str) -> float:
    """Epsilon of a non-empty history, from a fresh Opacus accountant (RDP: its arithmetic)."""
    _check_name(name)
    if name == "gdp":
        _warn_gdp()
    # imported here: Opacus pulls in torch, which a shard or the key holder never needs
    with root_logging_kept():
        from opacus.accountants import create_accountant

    with warnings.catch_warnings():
        # gdp's "experimental" warning (logged once instead), prv's alpha-range and overflow
        # warnings from its domain search.
        warnings.simplefilter("ignore")
        if name == "rdp":
            return _rdp_epsilon(history, delta)
        accountant = create_accountant(mechanism=name)
        accountant.history = list(history)
        return float(accountant.get_epsilon(delta=delta))


_cached = functools.lru_cache(maxsize=1024)(_compute)


def merged_history(
    entries: Iterable[tuple[float, float, int]],
) -> tuple[tuple[float, float, int], ...]:
    """``entries`` with consecutive ones of the same noise and rate as one, as Opacus merges them.

    Entries of no step are left out.
    """
    merged: list[tuple[float, float, int]] = []
    for sigma, q, steps in entries:
        if steps <= 0:
            continue
        if merged and merged[-1][:2] == (sigma, q):
            merged[-1] = (sigma, q, merged[-1][2] + steps)
        else:
            merged.append((sigma, q, steps))
    return tuple(merged)


def epsilon_of_history(history: _History, delta: float, accountant: str = "rdp") -> float:
    """Epsilon (at ``delta``) of an accountant history of ``(sigma, q, steps)`` entries.

    Parameters
    ----------
    history
        Opacus's format: one ``(noise_multiplier, sample_rate, steps)`` per stretch of steps
        with the same noise and sampling rate.
    delta
        The target delta.
    accountant
        ``"rdp"``, ``"prv"`` or ``"gdp"``.

    Returns
    -------
    float
        The epsilon; 0 for an empty history, ``inf`` where the accountant gives no bound.
        Results are cached: the RDP and PRV computations are slow.

    Raises
    ------
    ConfigError
        For an unknown accountant, a delta outside (0, 1), or (gdp) a history that changes
        the noise multiplier or sample rate.
    """
    _check_delta(delta)
    _check_name(accountant)
    entries = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0)
    if accountant == "gdp" and len(entries) > 1:  # Opacus's gdp reads the last entry only
        if len({entry[:2] for entry in entries}) > 1:
            raise ConfigError("the gdp accountant needs one noise multiplier and sample rate")
        entries = ((*entries[0][:2], sum(n for _, _, n in entries)),)
    return _cached(entries, delta, accountant) if entries else 0.0


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon after ``steps`` sampled Gaussian steps.

    Parameters
    ----------
    noise_multiplier
        Sigma: noise std divided by the sensitivity (the clipping norm).
    sample_rate
        Poisson sampling rate q in (0, 1].
    steps
        How many steps (0 gives epsilon 0).
    delta, accountant
        Same as :func:`epsilon_of_history`.

    Returns
    -------
    float
        The epsilon at ``delta``.

    Raises
    ------
    ConfigError
        For an unknown accountant or an argument out of range.
    """
    if noise_multiplier < 0:
        raise ConfigError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps}")
    return epsilon_of_history([(noise_multiplier, sample_rate, steps)], delta, accountant)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    *,
    rtol: float = 0.005,
) -> float:
    """The smallest noise multiplier (to ``rtol``) whose epsilon is at most the target.

    Doubles sigma until epsilon is at most ``target_epsilon``, then bisects, keeping as the
    upper end only sigmas whose epsilon was computed to be at most the target, until that
    epsilon is within ``rtol * target_epsilon`` below the target (or the bisection stops
    moving). The returned sigma's epsilon is computed once more, from a fresh accountant, and
    must be at most the target: calibration never overshoots.

    Parameters
    ----------
    target_epsilon
        The budget for the whole run.
    delta, sample_rate, accountant
        Same as :func:`epsilon`.
    steps
        Steps the run takes at ``sample_rate`` (example level: optimizer steps; client level:
        rounds).
    rtol
        How far below the target the epsilon may land, relative to it.

    Returns
    -------
    float
        Sigma with ``target * (1 - rtol) <= epsilon(sigma) <= target`` (the lower end is not
        guaranteed if the accountant's epsilon is not continuous in sigma).

    Raises
    ------
    ConfigError
        For an unknown accountant, arguments out of range, or a target that needs a sigma
        above 1e6.
    """
    if target_epsilon <= 0:
        raise ConfigError(f"target_epsilon must be > 0, got {target_epsilon}")
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if not 0 < rtol < 1:
        raise ConfigError(f"rtol must be in (0, 1), got {rtol}")

    def eps(sigma: float) -> float:
        try:
            return epsilon(sigma, sample_rate, steps, delta, accountant)
        except ConfigError:
            raise
        except (ValueError, ArithmeticError):
            # e.g. gdp's root finding fails for tiny sigma: no bound, so too little noise.
            return math.inf

    low, high = 0.0, 1.0
    eps_high = eps(high)
    while eps_high > target_epsilon:
        low, high = high, 2.0 * high
        if high > _MAX_SIGMA:
            raise ConfigError(
                f"target epsilon {target_epsilon} is out of reach: even noise multiplier "
                f"{_MAX_SIGMA:g} spends more over {steps} steps at sample rate {sample_rate}"
            )
        eps_high = eps(high)
    for _ in range(_MAX_BISECTIONS):
        if target_epsilon - eps_high <= rtol * target_epsilon:
            break
        mid = (low + high) / 2
        if not low < mid < high:
            break  # the interval cannot shrink further
        eps_mid = eps(mid)
        if eps_mid <= target_epsilon:
            high, eps_high = mid, eps_mid
        else:
            low = mid
    spent = _compute(((high, sample_rate, steps),), delta, accountant)  # fresh, not cached
    if spent > target_epsilon:
        raise AssertionError(f"calibration overshot: epsilon {spent} > {target_epsilon}")
    _log.debug(
        "calibrated sigma %.4f: epsilon %.4f <= %.4f (%s, q=%.4g, %d steps)",
        high,
        spent,
        target_epsilon,
        accountant,
        sample_rate,
        steps,
    )
    return high


@dataclass(frozen=True)
class ClientLevelNoise:
    """The distributed noise of client-level DP (DP-FedAvg) in a run.

    Each client adds ``share_std`` per coordinate, 1/``cohort`` of the variance the accountant
    assumes in a round's sum (``noise_multiplier * clip_norm``). Clients and the key holder
    derive it from the same configuration: the key holder tops a round's sum up to the full
    noise when fewer than ``cohort`` updates arrive (:meth:`top_up_std`).
    """

    noise_multiplier: float
    clip_norm: float
    cohort: int  # n, the shares the noise is split into
    sample_rate: float  # q = n / clients, the accountant's rate per global round

    @property
    def share_std(self) -> float:
        """One client's noise std per coordinate: sigma * C / sqrt(n)."""
        return self.noise_multiplier * self.clip_norm / math.sqrt(self.cohort)

    def top_up_std(self, contributors: int) -> float:
        """The std to add to a sum of ``contributors`` shares so it carries sigma * C."""
        return self.share_std * math.sqrt(max(0, self.cohort - contributors))

    def present_multiplier(self, contributors: int, top_up_std: float) -> float:
        """The noise multiplier a sum of ``contributors`` shares plus a top-up carries."""
        variance = contributors * self.share_std**2 + top_up_std**2
        return math.sqrt(variance) / self.clip_norm


def client_cohort(training: TrainingConfig) -> tuple[int, float]:
    """Client level: the cohort size n the noise is split into, and the Poisson rate q.

    n is ``training.cohort_size``, or every client when 0; q = n / ``training.clients``.
    """
    cohort = min(training.cohort_size or training.clients, training.clients)
    return cohort, cohort / training.clients


def client_level_noise(training: TrainingConfig, privacy: PrivacyConfig) -> ClientLevelNoise:
    """The run's client-level noise sigma, calibrated for ``training.rounds`` global rounds.

    At q = n / ``training.clients``, n the cohort size (``training.clients`` when 0).
    """
    cohort, rate = client_cohort(training)
    if privacy.target_epsilon is not None:
        sigma = calibrate_noise(
            privacy.target_epsilon, privacy.delta, rate, training.rounds, privacy.accountant
        )
    else:
        assert privacy.noise_multiplier is not None
        sigma = privacy.noise_multiplier
    return ClientLevelNoise(sigma, privacy.clip_norm, cohort, rate)
