"""Tests for clients.private_engine: ghost clipping sums the same clipped per-sample gradients as
Opacus's hooks, on layers with and without a ghost norm sampler, and both modes take their noise
from fedps's source, empty Poisson batches included."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from clients.private_engine import (
    CLIPPING,
    SourcedDPOptimizer,
    SourcedGhostDPOptimizer,
    SourcedPrivacyEngine,
    dp_backward,
)
from crypto.noise_pool import NoisePool
from crypto.randomness import SeededRandom
from fedps.errors import ConfigError
from fedps.learning.tasks import check_dp_trainable
from fedps.round_timer import RoundTimer

BATCH = 12
MAX_GRAD_NORM = 0.05  # below most examples' gradient norms: the clipping binds


class _Scale(torch.nn.Module):
    """A layer of its own: Opacus has neither a norm sampler nor a grad sampler for it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Tokens(torch.nn.Module):
    """Embedding (a ghost norm sampler) and LayerNorm (per-sample gradients) over tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(6 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.embedding(x)).flatten(1))
        return out


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.ReLU(), _Scale(16), torch.nn.Linear(16, 5)
    )


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.GroupNorm(2, 4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 5),
    )


def _tokens() -> torch.nn.Module:
    return _Tokens()


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[torch.Generator], torch.Tensor]]]
MODELS = {
    "linear-and-own-layer": (_mlp, lambda g: torch.randn(BATCH, 10, generator=g)),
    "conv-groupnorm": (_cnn, lambda g: torch.randn(BATCH, 1, 6, 6, generator=g)),
    "embedding-layernorm": (_tokens, lambda g: torch.randint(0, 20, (BATCH, 6), generator=g)),
}


def _private(
    model: torch.nn.Module, x: torch.Tensor, clipping: str, sigma: float, source: SeededRandom
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` made private by fedps's engine with ``clipping``; its module and optimizer."""
    loader = DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), batch_size=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
        engine = SourcedPrivacyEngine(accountant="rdp", noise=NoisePool(source), timer=RoundTimer())
        private = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=MAX_GRAD_NORM,
            poisson_sampling=True,
            grad_sample_mode=CLIPPING[clipping],
        )
    return private[0], private[1]


def _batch(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Model ``name`` with its weights, and a batch of BATCH rows for it (the same every call)."""
    create, inputs = MODELS[name]
    torch.manual_seed(0)
    model = create()
    check_dp_trainable(model, name)
    g = torch.Generator().manual_seed(1)
    return model, inputs(g), torch.randint(0, 5, (BATCH,), generator=g)


def _step_gradients(
    name: str, clipping: str, *, sigma: float = 0.0, empty: bool = False, seed: int = 0
) -> list[torch.Tensor]:
    """The gradients one DP-SGD step applies to model ``name`` (same weights, same batch)."""
    model, x, y = _batch(name)
    module, optimizer = _private(model, x, clipping, sigma, SeededRandom(seed))
    if empty:  # what a Poisson draw of no example gives
        x, y = x[:0], y[:0]
    optimizer.zero_grad()
    dp_backward(module, torch.nn.functional.cross_entropy, x, y)
    optimizer.step()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.privacy
@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_clipping_sums_the_same_clipped_gradients_as_per_sample(name: str) -> None:
    # Prepare: the batch's summed gradient, unclipped
    model, x, y = _batch(name)
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()  # type: ignore[no-untyped-call]
    unclipped = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    # Execute: one step of each mode, no noise
    ghost = _step_gradients(name, "ghost")
    per_sample = _step_gradients(name, "per_sample")

    # Assert: every parameter's gradient is the same to float32 rounding; the step is the sum
    # of BATCH clipped gradients over the expected batch size (12 rows at rate 1/3: 4)
    assert len(ghost) == len(per_sample) == len(list(MODELS[name][0]().parameters()))
    for a, b in zip(ghost, per_sample, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    total = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in ghost]))) * 4
    assert 0 < total <= MAX_GRAD_NORM * BATCH * (1 + 1e-5)
    assert total < 0.5 * float(torch.linalg.vector_norm(unclipped))  # the clipping binds


@pytest.mark.privacy
@pytest.mark.parametrize("clipping", list(CLIPPING))
def test_the_noise_comes_from_the_source_on_an_empty_batch(clipping: str) -> None:
    # Prepare: what a source seeded 7 draws for each parameter, at sigma * C
    shapes = [tuple(p.shape) for p in _mlp().parameters()]
    expected = NoisePool(SeededRandom(7))
    std = 1.5 * MAX_GRAD_NORM
    draws = [expected.normal(std, shape, dtype=np.float32) for shape in shapes]

    # Execute: a step on an empty Poisson batch, noise from a source seeded 7
    grads = _step_gradients("linear-and-own-layer", clipping, sigma=1.5, empty=True, seed=7)

    # Assert: the step's gradient is that noise alone, scaled by the expected batch size (4)
    for grad, draw in zip(grads, draws, strict=True):
        np.testing.assert_allclose(grad.numpy() * 4, draw, rtol=1e-6)


def test_the_engine_builds_the_optimizer_of_the_clipping() -> None:
    # Execute
    optimizers = {
        clipping: _private(_mlp(), torch.zeros(8, 10), clipping, 1.0, SeededRandom(0))[1]
        for clipping in CLIPPING
    }

    # Assert
    assert isinstance(optimizers["ghost"], SourcedGhostDPOptimizer)
    assert isinstance(optimizers["per_sample"], SourcedDPOptimizer)
    assert not isinstance(optimizers["per_sample"], SourcedGhostDPOptimizer)


def test_ghost_clipping_refuses_a_model_of_several_outputs() -> None:
    # Prepare: a model returning a tuple
    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(10, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.fc(x)
            return out, out

    x = torch.randn(4, 10)
    module, _ = _private(Pair(), x, "ghost", 1.0, SeededRandom(0))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out[0], y)

    # Execute / Assert: the fix is named
    with pytest.raises(ConfigError, match=re.escape('privacy.clipping = "per_sample"')):
        dp_backward(module, loss, x, torch.zeros(4, dtype=torch.long))


def test_ghost_clipping_refuses_a_layer_used_twice_and_names_the_fix() -> None:
    # Prepare: one Linear applied twice (tied parameters), which per-sample hooks accumulate
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(self.fc(x))
            return out

    x, y = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
    ghost, _ = _private(Twice(), x, "ghost", 1.0, SeededRandom(0))
    per_sample, _ = _private(Twice(), x, "per_sample", 1.0, SeededRandom(0))

    # Execute / Assert
    with pytest.raises(ConfigError, match=re.escape('privacy.clipping = "per_sample"')):
        dp_backward(ghost, torch.nn.functional.cross_entropy, x, y)
    dp_backward(per_sample, torch.nn.functional.cross_entropy, x, y)
