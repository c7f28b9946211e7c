"""Tests for server.shard.published_model.PublishedModel: a publish is checked whole before it
is installed, and the installed version is served to pulls."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import CkksParams
from fedps.errors import InvalidArgumentError, NotReadyError, RoundClosedError
from fedps.sharding.hash_ring import HashRing
from server.shard.published_model import PublishedModel

N = CkksParams().values_per_block  # values per block (the default ring, less its canaries)
NUM_BLOCKS = 4
SHARD = "shard-0"
RING = HashRing(["shard-0", "shard-1"])
OWNED = RING.assignment(NUM_BLOCKS)[SHARD]
FOREIGN_BLOCK = RING.assignment(NUM_BLOCKS)["shard-1"][0]


def _published() -> PublishedModel:
    """Version 1 published: block ``b`` holds ``b`` everywhere."""
    model = PublishedModel(SHARD, RING)
    model.publish(1, NUM_BLOCKS, N, {b: np.full(N, float(b)) for b in OWNED})
    return model


def test_the_shard_owns_some_blocks_and_not_all() -> None:
    # Assert: the tests below need this shard to own several blocks and the other at least one
    assert 2 <= len(OWNED) < NUM_BLOCKS


def test_publish_then_pull() -> None:
    # Prepare
    model = PublishedModel(SHARD, RING)
    values = {b: np.linspace(-1.0, 1.0, N) * (b + 1) for b in OWNED}

    # Execute
    count = model.publish(3, NUM_BLOCKS, N, values)
    version, blocks = model.pull(3)

    # Assert: every owned block, as float32 bytes.
    assert count == len(OWNED)
    assert version == 3
    assert list(model.owned) == OWNED
    assert sorted(blocks) == OWNED
    for b in OWNED:
        np.testing.assert_array_equal(
            np.frombuffer(blocks[b], dtype="<f4"), values[b].astype(np.float32)
        )
    assert model.pull(1)[0] == 3  # an older minimum is served the newer version


def test_pull_before_publish_is_not_ready() -> None:
    # Prepare
    model = PublishedModel(SHARD, RING)

    # Execute / Assert
    with pytest.raises(NotReadyError):
        model.pull(0)


def test_pull_of_future_version_is_refused() -> None:
    # Prepare
    model = _published()

    # Execute / Assert
    with pytest.raises(RoundClosedError, match="version 1"):
        model.pull(2)


@pytest.mark.parametrize("case", ["missing-block", "foreign-block", "bad-shape", "nan"])
def test_publish_rejects_malformed_blocks(case: str) -> None:
    # Prepare
    model = _published()
    blocks = {b: np.zeros(N) for b in OWNED}
    if case == "missing-block":
        del blocks[OWNED[0]]
    elif case == "foreign-block":
        blocks[FOREIGN_BLOCK] = np.zeros(N)
    elif case == "bad-shape":
        blocks[OWNED[0]] = np.zeros(N - 1)
    else:
        blocks[OWNED[0]][7] = np.nan

    # Execute / Assert: refused, and the published version 1 is untouched.
    with pytest.raises(InvalidArgumentError):
        model.publish(2, NUM_BLOCKS, N, blocks)
    version, pulled = model.pull(1)
    assert version == 1
    assert np.frombuffer(pulled[OWNED[0]], dtype="<f4")[0] == float(OWNED[0])


def test_publish_refuses_older_version() -> None:
    # Prepare
    model = _published()
    model.publish(2, NUM_BLOCKS, N, {b: np.zeros(N) for b in OWNED})

    # Execute / Assert: older versions, and jumps past the next one, are refused
    for version in (1, 4):
        with pytest.raises(InvalidArgumentError, match="does not follow"):
            model.publish(version, NUM_BLOCKS, N, {b: np.zeros(N) for b in OWNED})
    assert model.version == 2
