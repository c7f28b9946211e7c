"""Opacus's privacy engine with fedps's randomness: the DP noise and the Poisson batches.

Opacus draws the two random things of DP-SGD from torch's generator (its ``secure_mode`` needs
``torchcsprng``, which has no build for current torch). :class:`SourcedPrivacyEngine` overrides
both places: the optimizer adds noise from a :class:`~clients.noise_pool.NoisePool` (drawn
ahead, or now from its :class:`~crypto.randomness.RandomSource`), and the data loader samples
its batches with :class:`PoissonBatches` from the same source. :class:`clients.dp_trainer.DPTrainer`
builds one per client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data._utils.collate import default_collate

from clients.noise_pool import NoiseDraw, NoisePool
from crypto.randomness import RandomSource
from fedps.errors import ConfigError
from fedps.round_timer import RoundTimer
from fedps.startup import root_logging_kept

with root_logging_kept():  # Opacus configures the root logger when imported: not ours to keep
    from opacus import PrivacyEngine
    from opacus.data_loader import wrap_collate_with_empty
    from opacus.optimizers.optimizer import (
        DPOptimizer,
        _check_processed_flag,
        _mark_as_processed,
    )

__all__ = ["PoissonBatches", "SourcedDPOptimizer", "SourcedPrivacyEngine"]


class PoissonBatches(Sampler[list[int]]):
    """Poisson sampling for DP-SGD.

    Each of ``steps`` batches takes every example independently with probability ``sample_rate``,
    drawn from ``source`` (Opacus's ``UniformWithReplacementSampler`` draws from torch's generator
    instead).
    """

    def __init__(
        self, num_samples: int, sample_rate: float, steps: int, source: RandomSource
    ) -> None:
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = steps
        self.source = source

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = self.source.bernoulli(self.num_samples, self.sample_rate)
            yield [int(i) for i in np.flatnonzero(mask)]


class SourcedDPOptimizer(DPOptimizer):  # type: ignore[misc]  # Opacus is untyped
    """Opacus's DP optimizer with its Gaussian noise from a :class:`RandomSource`.

    The noise comes through ``noise`` (:class:`clients.noise_pool.NoisePool`: drawn ahead, or
    now from its source). The source is hardened as Opacus's ``secure_mode`` hardens it, and
    replaces torch's generator. What the noise costs the step is timed as the ``noise`` phase
    of ``timer``.
    """

    def __init__(self, *, noise: NoisePool, timer: RoundTimer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.noise = noise
        self.timer = timer

    @property
    def noise_std(self) -> float:
        """The std of the noise added to each summed gradient: sigma times the clipping norm."""
        return float(self.noise_multiplier * self.max_grad_norm)

    def noise_draws(self) -> list[NoiseDraw]:
        """The noise one step adds, parameter by parameter."""
        return [NoiseDraw(self.noise_std, tuple(p.shape), _noise_dtype(p)) for p in self.params]

    def add_noise(self) -> None:
        """Add one step's noise to every parameter's summed gradient (Opacus's step)."""
        std = self.noise_std
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            summed = p.summed_grad
            with self.timer.phase("noise"):  # drawn now, or taken as drawn ahead
                values = self.noise.normal(std, tuple(summed.shape), dtype=_noise_dtype(summed))
            noise = torch.from_numpy(values).to(dtype=summed.dtype, device=summed.device)
            p.grad = (summed + noise).view_as(p)
            _mark_as_processed(p.summed_grad)


def _noise_dtype(tensor: torch.Tensor) -> type[np.float32] | type[np.float64]:
    """The noise a tensor takes: float32 for float32 (the float64 value rounded once)."""
    return np.float32 if tensor.dtype == torch.float32 else np.float64


class SourcedPrivacyEngine(PrivacyEngine):  # type: ignore[misc]  # Opacus is untyped
    """A ``PrivacyEngine`` whose noise and Poisson sampling come from ``noise.source``.

    Opacus's own ``secure_mode`` needs ``torchcsprng``, which has no build for current torch;
    this engine overrides the two places Opacus draws randomness: the optimizer's noise (through
    ``noise``, which may have drawn it ahead) and the data loader's Poisson sampler. Only flat
    clipping in one process is supported (what fedps uses). ``timer`` times the noise.
    """

    def __init__(self, *, accountant: str, noise: NoisePool, timer: RoundTimer) -> None:
        super().__init__(accountant=accountant)
        self.noise = noise
        self.source = noise.source
        self.timer = timer

    def _prepare_optimizer(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int,
        loss_reduction: str = "mean",
        distributed: bool = False,
        clipping: str = "flat",
        grad_sample_mode: str = "hooks",
        **kwargs: Any,
    ) -> DPOptimizer:
        if distributed or clipping != "flat" or grad_sample_mode != "hooks":
            raise ConfigError("fedps's DP-SGD supports flat clipping in one process only")
        kwargs.pop("noise_generator", None)  # the source replaces torch's generator
        return SourcedDPOptimizer(
            optimizer=optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            noise=self.noise,
            timer=self.timer,
            **kwargs,
        )

    def _prepare_data_loader(
        self, data_loader: DataLoader[Any], *, poisson_sampling: bool, **kwargs: Any
    ) -> DataLoader[Any]:
        if not poisson_sampling:
            raise ConfigError("fedps's DP-SGD always samples batches by Poisson sampling")
        dataset = data_loader.dataset
        sample_rate = 1 / len(data_loader)
        first = dataset[0]
        sampler = PoissonBatches(
            len(dataset),  # type: ignore[arg-type]
            sample_rate,
            int(1 / sample_rate),  # as many batches as Opacus's Poisson loader draws
            self.source,
        )
        collate = wrap_collate_with_empty(
            collate_fn=default_collate,
            sample_empty_shapes=[(0, *x.shape) for x in first],
            dtypes=[x.dtype for x in first],
        )
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
