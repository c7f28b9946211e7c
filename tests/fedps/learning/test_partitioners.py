"""Tests for fedps.learning.partitioners: invariants, label skew, determinism and configuration
errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedps.errors import ConfigError
from fedps.learning.partitioners import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    ShardPartitioner,
    create_partitioner,
)

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _assert_valid(parts: list[npt.NDArray[np.int64]], num_samples: int, num_parts: int) -> None:
    """Check the partition contract: count, dtype, non-empty, disjoint, complete."""
    assert len(parts) == num_parts
    for part in parts:
        assert part.dtype == np.int64
        assert part.ndim == 1
        assert part.size > 0
    joined = np.concatenate(parts)
    assert joined.size == num_samples  # together with the next line: disjoint and complete
    np.testing.assert_array_equal(np.sort(joined), np.arange(num_samples))


def _assert_same(a: list[npt.NDArray[np.int64]], b: list[npt.NDArray[np.int64]]) -> None:
    """Check two partitionings are identical, order within partitions included."""
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        np.testing.assert_array_equal(left, right)


@st.composite
def labels_and_count(
    draw: st.DrawFn, *, max_samples: int = 300, min_per_partition: int = 1
) -> tuple[npt.NDArray[np.int64], int]:
    """Draw a label array and a partition count with at least ``min_per_partition`` rows each."""
    num_partitions = draw(st.integers(1, 20))
    num_samples = draw(st.integers(num_partitions * min_per_partition, max_samples))
    num_classes = draw(st.integers(1, 10))
    seed = draw(st.integers(0, 2**32 - 1))
    labels = np.random.default_rng(seed).integers(0, num_classes, num_samples).astype(np.int64)
    return labels, num_partitions


SEEDS = st.integers(0, 2**63 - 1)


# --- invariants (property-based) ---------------------------------------------------------------


@PROPERTY_SETTINGS
@given(data=labels_and_count(), seed=SEEDS)
def test_iid_invariants(data: tuple[npt.NDArray[np.int64], int], seed: int) -> None:
    # Prepare
    labels, num_parts = data
    partitioner = IidPartitioner()

    # Execute
    parts = partitioner.partition(labels, num_parts, seed)
    again = partitioner.partition(labels, num_parts, seed)

    # Assert
    _assert_valid(parts, labels.size, num_parts)
    _assert_same(parts, again)
    sizes = [part.size for part in parts]
    assert max(sizes) - min(sizes) <= 1


@PROPERTY_SETTINGS
@given(data=labels_and_count(), shards=st.integers(1, 5), seed=SEEDS)
def test_shard_invariants(data: tuple[npt.NDArray[np.int64], int], shards: int, seed: int) -> None:
    # Prepare
    labels, num_parts = data
    assume(num_parts * shards <= labels.size)
    partitioner = ShardPartitioner(num_shards_per_partition=shards)

    # Execute
    parts = partitioner.partition(labels, num_parts, seed)
    again = partitioner.partition(labels, num_parts, seed)

    # Assert
    _assert_valid(parts, labels.size, num_parts)
    _assert_same(parts, again)


@PROPERTY_SETTINGS
@given(
    data=labels_and_count(max_samples=400, min_per_partition=20),
    alpha=st.floats(1.0, 100.0),
    balancing=st.booleans(),
    seed=SEEDS,
)
def test_dirichlet_invariants(
    data: tuple[npt.NDArray[np.int64], int], alpha: float, balancing: bool, seed: int
) -> None:
    # Prepare: alpha >= 1 with >= 20 rows per partition makes 11 failed draws (each draw
    # leaving some partition empty) vanishingly rare; that legitimate outcome is skipped.
    labels, num_parts = data
    partitioner = DirichletPartitioner(alpha, min_partition_size=1, self_balancing=balancing)

    # Execute
    try:
        parts = partitioner.partition(labels, num_parts, seed)
    except ConfigError as exc:
        assert "attempts" in str(exc)
        assume(False)
    again = partitioner.partition(labels, num_parts, seed)

    # Assert
    _assert_valid(parts, labels.size, num_parts)
    _assert_same(parts, again)


@PROPERTY_SETTINGS
@given(data=labels_and_count(max_samples=200, min_per_partition=5), seed=SEEDS)
def test_dirichlet_respects_min_partition_size(
    data: tuple[npt.NDArray[np.int64], int], seed: int
) -> None:
    # Prepare
    labels, num_parts = data
    partitioner = DirichletPartitioner(alpha=0.5, min_partition_size=3)

    # Execute
    try:
        parts = partitioner.partition(labels, num_parts, seed)
    except ConfigError as exc:
        # Giving up after the bounded number of draws is allowed; returning too small is not.
        assert "attempts" in str(exc)
        return

    # Assert
    _assert_valid(parts, labels.size, num_parts)
    assert min(part.size for part in parts) >= 3


@pytest.mark.parametrize(
    "partitioner",
    [IidPartitioner(), DirichletPartitioner(1.0, 1), ShardPartitioner(2)],
    ids=repr,
)
def test_seed_changes_the_split(partitioner: Partitioner) -> None:
    # Prepare
    labels = np.repeat(np.arange(10, dtype=np.int64), 50)

    # Execute
    first = partitioner.partition(labels, 5, seed=1)
    second = partitioner.partition(labels, 5, seed=2)

    # Assert
    assert any(not np.array_equal(a, b) for a, b in zip(first, second, strict=True))


# --- label skew --------------------------------------------------------------------------------


def _mean_label_distance(
    parts: list[npt.NDArray[np.int64]], labels: npt.NDArray[np.int64]
) -> float:
    """Mean total-variation distance between each partition's label mix and the global mix."""
    num_classes = int(labels.max()) + 1
    overall = np.bincount(labels, minlength=num_classes) / labels.size
    distances = [
        0.5 * np.abs(np.bincount(labels[part], minlength=num_classes) / part.size - overall).sum()
        for part in parts
    ]
    return float(np.mean(distances))


def test_dirichlet_small_alpha_is_more_skewed_than_large_alpha() -> None:
    # Prepare
    labels = np.repeat(np.arange(10, dtype=np.int64), 200)
    skewed = DirichletPartitioner(alpha=0.1)
    near_iid = DirichletPartitioner(alpha=100.0)

    # Execute
    small = [_mean_label_distance(skewed.partition(labels, 10, s), labels) for s in range(5)]
    large = [_mean_label_distance(near_iid.partition(labels, 10, s), labels) for s in range(5)]

    # Assert: measured means are about 0.7 and 0.04.
    assert min(small) > 0.35
    assert max(large) < 0.15
    assert min(small) > 3 * max(large)


def test_shard_partitions_hold_few_labels() -> None:
    # Prepare: 100 rows per class and 50-row shards, so every shard holds a single label.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10, dtype=np.int64), 100))
    partitioner = ShardPartitioner(num_shards_per_partition=2)

    # Execute
    parts = partitioner.partition(labels, 10, seed=3)

    # Assert
    _assert_valid(parts, labels.size, 10)
    assert all(np.unique(labels[part]).size <= 2 for part in parts)
    assert all(part.size == 100 for part in parts)
    assert _mean_label_distance(parts, labels) > 0.75


def test_iid_partitions_are_balanced_in_labels() -> None:
    # Prepare
    labels = np.repeat(np.arange(10, dtype=np.int64), 200)

    # Execute
    parts = IidPartitioner().partition(labels, 10, seed=0)

    # Assert
    assert _mean_label_distance(parts, labels) < 0.1


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partitioner",
    [IidPartitioner(), DirichletPartitioner(1.0, 1), ShardPartitioner(1)],
    ids=repr,
)
def test_more_partitions_than_samples_raises(partitioner: Partitioner) -> None:
    # Prepare
    labels = np.zeros(4, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ConfigError, match="5"):
        partitioner.partition(labels, 5, seed=0)


@pytest.mark.parametrize(
    ("labels", "num_partitions", "seed", "match"),
    [
        (np.zeros((4, 2), dtype=np.int64), 2, 0, "1-D"),
        (np.zeros(4, dtype=np.float64), 2, 0, "integers"),
        (np.zeros(4, dtype=np.int64), 0, 0, "num_partitions"),
        (np.zeros(4, dtype=np.int64), 2.0, 0, "num_partitions"),
        (np.zeros(4, dtype=np.int64), True, 0, "num_partitions"),
        (np.zeros(4, dtype=np.int64), 2, -1, "seed"),
    ],
)
def test_partition_argument_validation(
    labels: npt.NDArray[Any], num_partitions: Any, seed: int, match: str
) -> None:
    # Prepare
    partitioner = IidPartitioner()

    # Execute / Assert
    with pytest.raises(ConfigError, match=match):
        partitioner.partition(labels, num_partitions, seed)


def test_shard_too_many_shards_raises() -> None:
    # Prepare
    labels = np.arange(10, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ConfigError, match="shards"):
        ShardPartitioner(num_shards_per_partition=3).partition(labels, 4, seed=0)


def test_dirichlet_infeasible_min_size_raises() -> None:
    # Prepare
    labels = np.zeros(50, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ConfigError, match="min_partition_size"):
        DirichletPartitioner(alpha=1.0, min_partition_size=10).partition(labels, 6, seed=0)


def test_dirichlet_gives_up_after_bounded_attempts() -> None:
    # Prepare: one class, alpha tiny, and exactly 10 rows needed by each of 10 partitions
    labels = np.zeros(100, dtype=np.int64)
    partitioner = DirichletPartitioner(alpha=0.01, min_partition_size=10, max_attempts=5)

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        partitioner.partition(labels, 10, seed=0)

    # Assert
    assert "5 attempts" in str(excinfo.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": "1"}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"alpha": 1.0, "min_partition_size": 0}, "min_partition_size"),
        ({"alpha": 1.0, "min_partition_size": 2.5}, "min_partition_size"),
        ({"alpha": 1.0, "max_attempts": 0}, "max_attempts"),
        ({"alpha": 1.0, "self_balancing": 1}, "self_balancing"),
    ],
)
def test_dirichlet_rejects_bad_parameters(kwargs: dict[str, Any], match: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=match):
        create_partitioner("dirichlet", **kwargs)


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", None])
def test_shard_rejects_bad_parameters(value: Any) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match="num_shards_per_partition"):
        create_partitioner("shard", num_shards_per_partition=value)


# --- registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "cls"),
    [
        ("iid", {}, IidPartitioner),
        ("dirichlet", {"alpha": 0.5}, DirichletPartitioner),
        ("dirichlet", {"alpha": 1, "min_partition_size": 2}, DirichletPartitioner),
        ("shard", {"num_shards_per_partition": 2}, ShardPartitioner),
    ],
)
def test_create_partitioner(name: str, kwargs: dict[str, Any], cls: type[Partitioner]) -> None:
    # Prepare / Execute
    partitioner = create_partitioner(name, **kwargs)

    # Assert
    assert type(partitioner) is cls
    for key, value in kwargs.items():
        assert getattr(partitioner, key) == value


def test_create_partitioner_unknown_name_lists_valid_names() -> None:
    # Prepare / Execute
    with pytest.raises(ConfigError) as excinfo:
        create_partitioner("pathological")

    # Assert
    message = str(excinfo.value)
    assert "pathological" in message
    for valid in ("dirichlet", "iid", "shard"):
        assert valid in message


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("iid", {"alpha": 1.0}, "unexpected arguments.*alpha.*accepted arguments: none"),
        ("dirichlet", {}, "missing a required argument: 'alpha'"),
        ("dirichlet", {"alpha": 1.0, "beta": 2}, "unexpected arguments.*beta"),
        ("shard", {"num_shards": 2}, "unexpected arguments.*num_shards.*num_shards_per_partition"),
    ],
)
def test_create_partitioner_bad_kwargs(name: str, kwargs: dict[str, Any], match: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=match):
        create_partitioner(name, **kwargs)
