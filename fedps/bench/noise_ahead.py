"""One client's DP-SGD round with its noise drawn ahead, against the noise drawn on demand.

An edge client draws the next round's DP noise while it waits between rounds
(:class:`crypto.noise_pool.NoisePool`); :func:`measure_noise_ahead` times what that takes off
a round: the same trainer trains rounds from the same model, alternating a round whose noise
was drawn ahead (the pool filled, and waited for, before the round: the client's idle time,
not counted) with a round that draws it all on demand, as before, after an idle wait as long.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from clients.client_setup import client_partition
from clients.dp_trainer import Trainer, create_trainer
from fedps.config import load_config
from fedps.learning.tasks import load_task
from fedps.sharding.blocks import flatten_model

__all__ = ["client_trainer", "measure_noise_ahead"]

_FILL_TIMEOUT_S = 600.0  # a hang guard: the pool fills in seconds


def client_trainer(model: str, **privacy: object) -> Trainer:
    """Client 0 of 4's trainer on digits with ``model`` and the ``privacy`` settings given.

    The job's defaults otherwise (for ``mlp1m``: 1,076,010 parameters, 12 steps a round).
    """
    config = load_config(
        None, training={"dataset": "digits", "model": model, "clients": 4}, privacy=privacy
    )
    task = load_task(config)
    return create_trainer(
        task.create_model(config.training.seed),
        client_partition(config, 0, task=task),
        training=config.training,
        privacy=config.privacy,
        task=task,
    )


def measure_noise_ahead(
    model: str = "mlp1m", *, repeats: int = 7, noise_multiplier: float = 1.0
) -> dict[str, Any]:
    """Client 0 of 4's DP-SGD round on digits, its noise drawn ahead or on demand.

    The job's defaults otherwise (for ``mlp1m``: 1,076,010 parameters, 12 steps a round).
    One round first to warm up, then ``repeats`` of each kind, alternating.

    Parameters
    ----------
    model
        The model (:mod:`fedps.learning.models`).
    repeats
        Rounds of each kind.
    noise_multiplier
        DP-SGD's sigma.

    Returns
    -------
    dict
        Medians: ``round_s_on_demand``, ``round_s_ahead`` and their ratio ``ratio`` (ahead /
        on demand); the round's ``noise`` phase in each, ``noise_s_on_demand`` and
        ``noise_s_ahead``; ``fill_s``, how long the low-priority thread took to draw a round's
        noise; ``values`` and ``arrays``, the noise values of a round and the arrays they
        come in (one per step and parameter); ``from_pool``, the share of the arrays of the
        rounds with noise drawn ahead that came from the pool (1: all); ``rounds_s``, every
        round's seconds of each kind, in order.
    """
    trainer = client_trainer(model, noise_multiplier=noise_multiplier)
    start = flatten_model(trainer.model)
    plan = trainer.noise_of_next_round()
    times: dict[str, list[float]] = {"on_demand": [], "ahead": [], "fill": []}
    noise: dict[str, list[float]] = {"on_demand": [], "ahead": []}

    def round_(kind: str) -> None:
        trainer.timer.reset()
        began = time.perf_counter()
        trainer.train_round(start)
        times[kind].append(time.perf_counter() - began)
        noise[kind].append(trainer.timer.seconds().get("noise", 0.0))

    try:
        trainer.train_round(start)  # warm-up
        for _ in range(repeats):
            began = time.perf_counter()
            trainer.draw_noise_ahead()
            if not trainer.noise_pool.wait(_FILL_TIMEOUT_S):
                raise RuntimeError("the noise pool did not fill")
            times["fill"].append(time.perf_counter() - began)
            round_("ahead")
            time.sleep(times["fill"][-1])  # the same wait before a round drawn on demand
            round_("on_demand")
    finally:
        trainer.close()
    median = {kind: statistics.median(seconds) for kind, seconds in times.items()}
    return {
        "values": float(sum(draw.size for draw in plan)),
        "arrays": float(len(plan)),
        "round_s_on_demand": median["on_demand"],
        "round_s_ahead": median["ahead"],
        "ratio": median["ahead"] / median["on_demand"],
        "noise_s_on_demand": statistics.median(noise["on_demand"]),
        "noise_s_ahead": statistics.median(noise["ahead"]),
        "fill_s": median["fill"],
        "from_pool": trainer.noise_pool.taken / (repeats * len(plan)),
        "rounds_s": {"on_demand": times["on_demand"], "ahead": times["ahead"]},
    }
