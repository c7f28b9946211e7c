"""Opacus's privacy engine with fedps's randomness: the DP noise and the Poisson batches.

Opacus draws the two random things of DP-SGD from torch's generator (its ``secure_mode`` needs
``torchcsprng``, which has no build for current torch). :class:`SourcedPrivacyEngine` overrides
both places: the optimizer adds noise from a :class:`~crypto.noise_pool.NoisePool` (drawn
ahead, or now from its :class:`~crypto.randomness.RandomSource`), and the data loader samples
its batches with :class:`PoissonBatches` from the same source. :class:`clients.dp_trainer.DPTrainer`
builds one per client.

The per-sample gradients are clipped one of two ways (``privacy.clipping``, :data:`CLIPPING`):
``"ghost"`` is Opacus's fast gradient clipping, which computes each example's gradient norm
without materialising its gradient and backpropagates a second time with the clipping factors
(:func:`dp_backward`); ``"per_sample"`` is Opacus's hooks, which materialise every example's
gradient (batch size x parameters floats) and clip them in the optimizer. Both give the sum of
the clipped per-sample gradients, to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data._utils.collate import default_collate

from crypto.noise_pool import NoiseDraw, NoisePool
from crypto.randomness import RandomSource
from fedps.errors import ConfigError
from fedps.round_timer import RoundTimer
from fedps.startup import root_logging_kept

with root_logging_kept():  # Opacus configures the root logger when imported: not ours to keep
    from opacus import PrivacyEngine
    from opacus.data_loader import wrap_collate_with_empty
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.optimizers.optimizer import (
        DPOptimizer,
        _check_processed_flag,
        _mark_as_processed,
    )

__all__ = [
    "CLIPPING",
    "PoissonBatches",
    "SourcedDPOptimizer",
    "SourcedGhostDPOptimizer",
    "SourcedPrivacyEngine",
    "dp_backward",
]

#: ``privacy.clipping`` -> Opacus's ``grad_sample_mode``: how per-sample gradients are clipped.
CLIPPING = {"ghost": "ghost", "per_sample": "hooks"}


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


class _SourcedNoise:
    """The noise part of a DP optimizer: Gaussian noise from a :class:`NoisePool`.

    Mixed in before one of Opacus's DP optimizers (its ``add_noise`` replaces theirs). The noise
    comes through ``noise`` (:class:`crypto.noise_pool.NoisePool`: drawn ahead, or now from its
    source). The source is hardened as Opacus's ``secure_mode`` hardens it, and replaces torch's
    generator. What the noise costs the step is timed as the ``noise`` phase of ``timer``.
    """

    noise_multiplier: float
    max_grad_norm: float
    params: list[Any]  # Opacus's parameters, which carry its summed_grad

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


class SourcedDPOptimizer(_SourcedNoise, DPOptimizer):  # type: ignore[misc]  # Opacus is untyped
    """Opacus's DP optimizer with its Gaussian noise from a :class:`NoisePool`.

    It clips the per-sample gradients that Opacus's hooks materialised, sums them and adds
    noise through ``noise`` (drawn ahead, or now from its source), hardened as Opacus's
    ``secure_mode`` hardens it; its cost is timed as the ``noise`` phase of ``timer``.
    """


class SourcedGhostDPOptimizer(_SourcedNoise, DPOptimizerFastGradientClipping):  # type: ignore[misc]
    """Opacus's fast-gradient-clipping optimizer with its noise from a :class:`NoisePool`.

    The gradients it is given are already the sums of the clipped per-sample gradients
    (:func:`dp_backward`); it adds the noise, scales and steps. The noise comes through
    ``noise`` (drawn ahead, or now from its source), hardened as Opacus's ``secure_mode``
    hardens it; its cost is timed as the ``noise`` phase of ``timer``.
    """


def _noise_dtype(tensor: torch.Tensor) -> type[np.float32] | type[np.float64]:
    """The noise a tensor takes: float32 for float32 (the float64 value rounded once)."""
    return np.float32 if tensor.dtype == torch.float32 else np.float64


class SourcedPrivacyEngine(PrivacyEngine):  # type: ignore[misc]  # Opacus is untyped
    """A ``PrivacyEngine`` whose noise and Poisson sampling come from ``noise.source``.

    Opacus's own ``secure_mode`` needs ``torchcsprng``, which has no build for current torch;
    this engine overrides the two places Opacus draws randomness: the optimizer's noise (through
    ``noise``, which may have drawn it ahead) and the data loader's Poisson sampler. Only flat
    clipping in one process is supported (what fedps uses), with the per-sample gradients of
    Opacus's hooks or of its ghost clipping (``grad_sample_mode`` ``"hooks"`` or ``"ghost"``,
    :data:`CLIPPING`). ``timer`` times the noise.
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
        if distributed or clipping != "flat" or grad_sample_mode not in CLIPPING.values():
            raise ConfigError("fedps's DP-SGD supports flat clipping in one process only")
        kwargs.pop("noise_generator", None)  # the source replaces torch's generator
        ghost = grad_sample_mode == "ghost"
        optimizer_class = SourcedGhostDPOptimizer if ghost else SourcedDPOptimizer
        return optimizer_class(
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


def dp_backward(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """Run one batch forward and backward for the DP optimizer's next step; return its loss.

    With Opacus's hooks this is ``loss.backward()``: the hooks materialise the per-sample
    gradients and the optimizer clips them. With ghost clipping (``module`` an Opacus
    ``GradSampleModuleFastGradientClipping``; Li et al. 2022, "Large Language Models Can Be
    Strong Differentially Private Learners", and Bu et al. 2023) it is two passes, as in
    Opacus's ``DPTensorFastGradientClipping.backward``: the first computes each example's
    gradient norm in the hooks (from activations and backprops for the layers Opacus has a norm
    sampler for, Linear and Embedding; every other layer's per-sample gradient is materialised,
    one layer at a time, and its norm taken), the second backpropagates each example's part of
    the loss times its clipping factor ``min(1, max_grad_norm / (norm + 1e-6))`` with the hooks
    off, which leaves in each parameter's gradient the sum of the clipped per-sample gradients.

    The second pass starts from the gradient of the model's output rather than from
    per-example losses (Opacus's loss wrapper needs a loss module with a ``reduction`` to switch
    off, and a task's loss is any function): example i's part is its row of that gradient,
    scaled as the hooks scale backprops (times the batch size for a mean loss). That is the
    per-sample gradient the hooks mode clips, so the two modes sum the same clipped gradients.

    An empty batch (Poisson sampling can draw one) has no gradient: the step adds noise only.
    Opacus's ghost norm samplers cannot take it, so with ghost clipping it runs without hooks.

    Parameters
    ----------
    module
        The module ``make_private`` returned.
    loss_fn
        The loss of a batch's outputs against its targets (a mean over the batch).
    x, y
        The batch (batch first).

    Returns
    -------
    torch.Tensor
        The batch's loss (0 for an empty batch).

    Raises
    ------
    ConfigError
        With ghost clipping, if the module's output is not one tensor or it uses a Linear or
        Embedding layer twice in one forward pass (parameter tying).
    """
    ghost = isinstance(module, GradSampleModuleFastGradientClipping)
    loss: torch.Tensor
    if not len(y):
        with _hooks_off(module) if ghost else nullcontext():
            loss = module(x).sum() * 0.0
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        return loss
    try:
        output = module(x)
    except NotImplementedError as exc:  # ghost clipping: a Linear or Embedding used twice
        raise ConfigError(f'{exc}: use privacy.clipping = "per_sample"') from exc
    loss = loss_fn(output, y)
    if ghost:
        _clipped_backward(module, output, loss)
    else:
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
    return loss


def _clipped_backward(
    module: GradSampleModuleFastGradientClipping, output: torch.Tensor, loss: torch.Tensor
) -> None:
    """Ghost clipping's two backward passes (:func:`dp_backward`)."""
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            'privacy.clipping = "ghost" needs a model that returns one tensor; '
            'use privacy.clipping = "per_sample"'
        )
    output.retain_grad()
    loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]  # the norms, in the hooks
    assert output.grad is not None
    scale = module.get_clipping_coef() * (len(output) if module.loss_reduction == "mean" else 1)
    for p in module.parameters():
        p.grad = None
    with _hooks_off(module):
        output.backward(output.grad * scale.view(-1, *[1] * (output.dim() - 1)))  # type: ignore[no-untyped-call]


@contextmanager
def _hooks_off(module: GradSampleModuleFastGradientClipping) -> Iterator[None]:
    """Opacus's hooks on ``module`` switched off inside the ``with`` block."""
    module.disable_hooks()
    try:
        yield
    finally:
        module.enable_hooks()
