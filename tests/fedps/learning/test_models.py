"""Tests for fedps.learning.models: the registry, deterministic initialisation and output shapes."""

from __future__ import annotations

import pytest
import torch

from fedps.errors import ConfigError
from fedps.learning.models import create_model, model_names
from fedps.sharding.blocks import flatten_model

_FEATURES = {"mlp": 64, "logreg": 64, "cnn": 784}


def test_registry_names() -> None:
    # Prepare / Execute
    names = model_names()

    # Assert
    assert names == ["cnn", "logreg", "mlp", "mlp10m", "mlp1m"]


@pytest.mark.parametrize(("name", "size"), [("mlp1m", 1_076_010), ("mlp10m", 10_161_910)])
def test_wide_models_have_their_size(name: str, size: int) -> None:
    # Prepare / Execute
    model = create_model(name, num_features=64, num_classes=10)

    # Assert
    assert flatten_model(model).size == size


def test_unknown_name_raises_config_error_listing_choices() -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=r"unknown model 'resnet'.*mlp"):
        create_model("resnet", num_features=64, num_classes=10)


def test_cnn_needs_square_inputs() -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match="square"):
        create_model("cnn", num_features=65, num_classes=10)


@pytest.mark.parametrize("name", sorted(_FEATURES))
def test_same_seed_gives_same_weights(name: str) -> None:
    # Prepare
    features = _FEATURES[name]

    # Execute
    first = flatten_model(create_model(name, num_features=features, num_classes=10, seed=7))
    torch.manual_seed(12345)  # the global RNG state must not matter
    second = flatten_model(create_model(name, num_features=features, num_classes=10, seed=7))
    other = flatten_model(create_model(name, num_features=features, num_classes=10, seed=8))

    # Assert
    assert (first == second).all()
    assert not (first == other).all()


@pytest.mark.parametrize("name", sorted(_FEATURES))
@pytest.mark.parametrize("num_classes", [2, 10])
def test_output_shape(name: str, num_classes: int) -> None:
    # Prepare
    features = _FEATURES[name]
    model = create_model(name, num_features=features, num_classes=num_classes)
    x = torch.rand(3, features)

    # Execute
    with torch.no_grad():
        out = model(x)

    # Assert
    assert out.shape == (3, num_classes)
    assert torch.isfinite(out).all()


def test_models_have_no_batch_norm() -> None:
    # Prepare: Opacus needs per-sample gradients, which BatchNorm would mix across samples.
    models = [create_model(n, num_features=_FEATURES[n], num_classes=10) for n in _FEATURES]

    # Execute
    kinds = {type(m).__name__ for model in models for m in model.modules()}

    # Assert
    assert not any("BatchNorm" in kind for kind in kinds)
