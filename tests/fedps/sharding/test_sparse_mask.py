"""Tests for fedps.sharding.sparse_mask: the shared mask of a sparsified round."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedps.errors import InvalidArgumentError
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.sparse_mask import SparseMask, mask_seed, sent_blocks, upload_layout

_masks = st.builds(
    lambda n, per, density, seed: SparseMask(BlockLayout(n, per), density, seed),
    st.integers(1, 3000),
    st.integers(1, 300),
    st.floats(0.001, 1.0),
    st.binary(min_size=32, max_size=32),
)


@given(_masks)
def test_a_mask_fills_its_blocks_with_distinct_increasing_coordinates(mask: SparseMask) -> None:
    # Execute
    chosen = mask.indices()

    # Assert
    layout = mask.layout
    assert mask.size == min(layout.num_params, mask.sent_blocks * layout.values_per_block)
    assert mask.packed.num_blocks == mask.sent_blocks <= layout.num_blocks
    assert chosen.size == mask.size and np.all(np.diff(chosen) > 0)
    assert chosen[0] >= 0 and chosen[-1] < layout.num_params
    np.testing.assert_array_equal(mask.indices(), chosen)  # the same for every party


@given(_masks, st.integers(0, 2**32 - 1))
def test_scatter_puts_back_what_gather_took(mask: SparseMask, draw: int) -> None:
    # Prepare
    vector = np.random.default_rng(draw).normal(size=mask.layout.num_params)

    # Execute
    back = mask.scatter(mask.gather(vector))

    # Assert: the chosen coordinates are the vector's, every other is zero
    chosen = np.zeros(vector.size, dtype=bool)
    chosen[mask.indices()] = True
    np.testing.assert_array_equal(back[chosen], vector[chosen])
    assert not back[~chosen].any()


def test_sent_blocks_rounds_up_and_never_exceeds_the_model() -> None:
    # Execute / Assert
    assert sent_blocks(30, 0.1) == 3  # not 4 for 3.0000000000000004
    assert sent_blocks(526, 0.1) == 53
    assert sent_blocks(3, 0.1) == 1
    assert sent_blocks(3, 1.0) == 3
    assert sent_blocks(0, 0.5) == 0  # no model yet
    for density in (0.0, 1.5, -0.1):
        with pytest.raises(InvalidArgumentError, match="density"):
            sent_blocks(3, density)


@given(
    num_params=st.integers(1, 3_000_000),
    fields=st.integers(1, 4),
    density=st.sampled_from([0.05, 0.1, 0.5, 1.0]),
)
def test_packed_updates_send_what_their_layout_holds(
    num_params: int, fields: int, density: float
) -> None:
    # Prepare: a shard knows only the model's blocks; a client the packed update's layout
    model = BlockLayout(num_params, 2016)
    packed = upload_layout(model, fields)

    # Execute
    shard_view = sent_blocks(model.num_blocks, density, fields)
    mask = SparseMask(packed, density, os.urandom(32))

    # Assert: both count the same blocks, and the mask fills them with K x V values each
    assert packed.num_blocks == -(-model.num_blocks // fields)
    assert shard_view == mask.sent_blocks == sent_blocks(packed.num_blocks, density)
    assert mask.size == min(num_params, shard_view * fields * 2016)


def test_other_seeds_pick_other_coordinates_and_the_seed_is_one_way() -> None:
    # Prepare
    layout = BlockLayout(100_000, 2048)
    challenges = [os.urandom(32) for _ in range(2)]

    # Execute
    masks = [SparseMask(layout, 0.1, mask_seed(c)) for c in challenges]

    # Assert: about the expected overlap of two independent draws, and a labelled hash
    first, second = (set(m.indices().tolist()) for m in masks)
    overlap = len(first & second) / len(first)
    assert 0.05 < overlap < 0.17
    assert masks[0].seed == hashlib.sha256(b"fedps-sparse-mask-v1" + challenges[0]).digest()
    assert masks[0].seed != challenges[0]


def test_a_bad_seed_or_vector_is_refused() -> None:
    # Prepare
    mask = SparseMask(BlockLayout(10, 4), 0.5, bytes(32))

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        SparseMask(BlockLayout(10, 4), 0.5, bytes(16))
    with pytest.raises(InvalidArgumentError, match="10 values"):
        mask.gather(np.zeros(9))
    with pytest.raises(InvalidArgumentError, match="packed update"):
        mask.scatter(np.zeros(10))
