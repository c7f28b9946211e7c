"""Opacus-compatible models by name (no BatchNorm: per-sample gradients need GroupNorm).

``create_model("mlp", num_features=64, num_classes=10)`` builds the digits default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedps._registry import add_entry
from fedps.errors import ConfigError

__all__ = ["create_model", "model_names", "register_model"]


def _mlp(num_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(num_features, 64), nn.ReLU(), nn.Linear(64, num_classes))


def _mlp1m(num_features: int, num_classes: int) -> nn.Module:
    """A wide MLP of about one million parameters (benchmarks at scale)."""
    return nn.Sequential(
        nn.Linear(num_features, 1000),
        nn.ReLU(),
        nn.Linear(1000, 1000),
        nn.ReLU(),
        nn.Linear(1000, num_classes),
    )


def _mlp10m(num_features: int, num_classes: int) -> nn.Module:
    """A wide MLP of about ten million parameters (one round at scale)."""
    return nn.Sequential(
        nn.Linear(num_features, 3150),
        nn.ReLU(),
        nn.Linear(3150, 3150),
        nn.ReLU(),
        nn.Linear(3150, num_classes),
    )


def _logreg(num_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(num_features, num_classes))


class _Cnn(nn.Module):
    """A small CNN for 28x28 images (in the spirit of Tramer and Boneh 2021).

    Pixels in [0, 1] are centred to [-1, 1] first: the tanh units train faster on inputs
    around zero (standardised Fashion-MNIST pixels gained about one point of accuracy after
    5 rounds of DP-SGD, docs/privacy-accuracy.md).
    """

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        side = round(num_features**0.5)
        if side * side != num_features:
            raise ConfigError(f"cnn needs square images, got {num_features} features")
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
        )
        with torch.no_grad():
            out = self.features(torch.zeros(1, 1, side, side)).numel()
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(out, 32), nn.Tanh(), nn.Linear(32, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.view(-1, 1, self.side, self.side) * 2.0 - 1.0
        out: torch.Tensor = self.head(self.features(images))
        return out


_MODELS: dict[str, Callable[[int, int], nn.Module]] = {
    "cnn": _Cnn,
    "logreg": _logreg,
    "mlp": _mlp,
    "mlp1m": _mlp1m,
    "mlp10m": _mlp10m,
}


def register_model(name: str, factory: Callable[[int, int], nn.Module]) -> None:
    """Make ``factory(num_features, num_classes)`` available to :func:`create_model` as ``name``.

    And to ``training.model``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_MODELS, name, factory, "model")


def model_names() -> list[str]:
    """Registered model names."""
    return sorted(_MODELS)


def create_model(name: str, *, num_features: int, num_classes: int, seed: int = 0) -> nn.Module:
    """Build a registered model with deterministic initial weights.

    Raises
    ------
    ConfigError
        If ``name`` is not registered.
    """
    try:
        factory = _MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of {model_names()}") from None
    torch.manual_seed(seed)
    return factory(num_features, num_classes)
