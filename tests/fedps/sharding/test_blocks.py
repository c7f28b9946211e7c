"""Tests for fedps.sharding.blocks: block layout arithmetic and model <-> flat vector round
trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedps.errors import ConfigError, InvalidArgumentError
from fedps.learning.models import create_model
from fedps.sharding.blocks import BlockLayout, flatten_model, group_mask, load_flat

_sizes = st.tuples(st.integers(1, 5000), st.integers(1, 700))


@given(_sizes)
def test_num_blocks_covers_every_value_with_one_partial_block(sizes: tuple[int, int]) -> None:
    # Prepare
    num_params, per_block = sizes
    layout = BlockLayout(num_params, per_block)

    # Execute
    blocks = layout.num_blocks

    # Assert: enough blocks, and dropping one would not be enough.
    assert blocks * per_block >= num_params
    assert (blocks - 1) * per_block < num_params


@given(_sizes)
def test_block_of_pads_with_zeros_and_join_round_trips(sizes: tuple[int, int]) -> None:
    # Prepare
    num_params, per_block = sizes
    layout = BlockLayout(num_params, per_block)
    vector = np.arange(1, num_params + 1, dtype=np.float64)

    # Execute
    blocks = {b: layout.block_of(vector, b) for b in range(layout.num_blocks)}
    joined = layout.join(blocks)

    # Assert
    assert all(block.shape == (per_block,) for block in blocks.values())
    padding = layout.num_blocks * per_block - num_params
    last = blocks[layout.num_blocks - 1]
    assert np.all(last[per_block - padding :] == 0.0)
    assert np.all(last[: per_block - padding] != 0.0)
    assert joined.dtype == np.float64
    np.testing.assert_array_equal(joined, vector)


@given(_sizes, st.data())
def test_join_with_a_missing_block_raises(sizes: tuple[int, int], data: st.DataObject) -> None:
    # Prepare
    num_params, per_block = sizes
    layout = BlockLayout(num_params, per_block)
    missing = data.draw(st.integers(0, layout.num_blocks - 1))
    blocks = {b: np.zeros(per_block) for b in range(layout.num_blocks) if b != missing}

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="missing blocks"):
        layout.join(blocks)


def test_join_with_a_wrong_length_block_raises() -> None:
    # Prepare
    layout = BlockLayout(10, 4)
    blocks = {0: np.zeros(4), 1: np.zeros(4), 2: np.zeros(2)}

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="block 2"):
        layout.join(blocks)


@pytest.mark.parametrize("block", [-1, 3])
def test_block_of_out_of_range_raises(block: int) -> None:
    # Prepare
    layout = BlockLayout(10, 4)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="out of range"):
        layout.block_of(np.zeros(10), block)


@pytest.mark.parametrize(("num_params", "per_block"), [(0, 4), (4, 0), (-1, 4)])
def test_layout_rejects_non_positive_sizes(num_params: int, per_block: int) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(InvalidArgumentError):
        BlockLayout(num_params, per_block)


@pytest.mark.parametrize(("name", "features"), [("mlp", 64), ("cnn", 784)])
def test_flatten_load_flat_round_trip(name: str, features: int) -> None:
    # Prepare
    model = create_model(name, num_features=features, num_classes=10, seed=1)
    count = sum(p.numel() for p in model.parameters())
    target = np.random.default_rng(0).standard_normal(count).astype(np.float32).astype(np.float64)

    # Execute
    load_flat(model, target)
    flat = flatten_model(model)

    # Assert: same values, in named_parameters() order.
    assert flat.dtype == np.float64
    assert flat.shape == (count,)
    np.testing.assert_array_equal(flat, target)
    first = next(iter(model.parameters()))
    np.testing.assert_array_equal(
        first.detach().reshape(-1).numpy(), target[: first.numel()].astype(np.float32)
    )


def test_flatten_then_load_into_fresh_model_gives_same_outputs() -> None:
    # Prepare
    source = create_model("mlp", num_features=64, num_classes=10, seed=1)
    target = create_model("mlp", num_features=64, num_classes=10, seed=2)
    x = torch.rand(5, 64)

    # Execute
    load_flat(target, flatten_model(source))

    # Assert
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x))


@pytest.mark.parametrize("delta", [-1, 1])
def test_load_flat_wrong_length_raises(delta: int) -> None:
    # Prepare
    model = create_model("mlp", num_features=64, num_classes=10)
    count = flatten_model(model).size
    before = flatten_model(model)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="parameters"):
        load_flat(model, np.zeros(count + delta))
    np.testing.assert_array_equal(flatten_model(model), before)


def test_load_flat_rejects_two_dimensional_vector() -> None:
    # Prepare
    model = create_model("logreg", num_features=64, num_classes=10)
    count = flatten_model(model).size

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        load_flat(model, np.zeros((1, count)))


def test_group_mask_marks_exactly_the_matching_parameters() -> None:
    # Prepare: the digits MLP, layers "0" (64x64 + 64) and "2" (64x10 + 10)
    model = create_model("mlp", num_features=64, num_classes=10)
    # Execute
    mask = group_mask(model, ["2.*"])
    # Assert: the last 650 values, in flatten_model order
    assert mask.size == flatten_model(model).size == 4810
    assert mask.sum() == 650 and mask[-650:].all()


def test_group_mask_refuses_a_pattern_that_matches_nothing() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"match none of: 0\.weight"):
        group_mask(create_model("mlp", num_features=64, num_classes=10), ["embed.*"])
