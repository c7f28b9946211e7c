"""One client's DP-SGD round with ghost clipping against Opacus's per-sample gradients.

``privacy.clipping`` picks how DP-SGD clips per-sample gradients
(:func:`clients.private_engine.dp_backward`): ``"ghost"`` computes each example's gradient norm
without materialising its gradient and backpropagates twice; ``"per_sample"`` materialises
every example's gradient (Opacus's hooks). :func:`measure_clipping` times one round of each on
the same client, from the same model, alternating, in one process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from fedps.bench.noise_ahead import client_trainer
from fedps.sharding.blocks import flatten_model

__all__ = ["measure_clipping"]

_MODES = ("per_sample", "ghost")


def measure_clipping(
    model: str = "mlp1m", *, repeats: int = 5, noise_multiplier: float = 1.0
) -> dict[str, Any]:
    """Client 0 of 4's DP-SGD round on digits, clipped each way.

    One trainer per mode, the same model, data and settings (the noise drawn on demand in both,
    ``privacy.noise_ahead_mib`` 0); one round of each to warm up, then ``repeats`` of each,
    alternating (the order swapped every repeat), each from the same parameters.

    Parameters
    ----------
    model
        The model (:mod:`fedps.learning.models`).
    repeats
        Rounds of each mode.
    noise_multiplier
        DP-SGD's sigma.

    Returns
    -------
    dict
        Per mode (``per_sample``, ``ghost``): ``round_s`` and ``noise_s``, the medians of the
        round's seconds and of its ``noise`` phase, and ``rounds_s``, every round's seconds in
        order; ``ratio``, ghost's median round over per_sample's, and ``train_ratio``, the same
        without the noise phase.
    """
    trainers = {
        mode: client_trainer(
            model, noise_multiplier=noise_multiplier, noise_ahead_mib=0, clipping=mode
        )
        for mode in _MODES
    }
    start = flatten_model(trainers["ghost"].model)
    rounds: dict[str, list[float]] = {mode: [] for mode in _MODES}
    noise: dict[str, list[float]] = {mode: [] for mode in _MODES}
    try:
        for trainer in trainers.values():
            trainer.train_round(start)  # warm-up
        for repeat in range(repeats):
            for mode in _MODES[:: 1 if repeat % 2 == 0 else -1]:
                trainer = trainers[mode]
                trainer.timer.reset()
                began = time.perf_counter()
                trainer.train_round(start)
                rounds[mode].append(time.perf_counter() - began)
                noise[mode].append(trainer.timer.seconds().get("noise", 0.0))
    finally:
        for trainer in trainers.values():
            trainer.close()
    result: dict[str, Any] = {
        mode: {
            "round_s": statistics.median(rounds[mode]),
            "noise_s": statistics.median(noise[mode]),
            "rounds_s": rounds[mode],
        }
        for mode in _MODES
    }
    ghost, per_sample = result["ghost"], result["per_sample"]
    result["ratio"] = ghost["round_s"] / per_sample["round_s"]
    result["train_ratio"] = (ghost["round_s"] - ghost["noise_s"]) / (
        per_sample["round_s"] - per_sample["noise_s"]
    )
    return result
