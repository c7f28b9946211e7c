"""Split a training set's row indices over federated clients.

The partitioners follow the ones of ``flwr-datasets`` (same names and algorithms) but work on a
plain label array and return index arrays, so they fit any in-memory dataset:

* `IidPartitioner` (``"iid"``): a seeded shuffle cut into near-equal parts.
* `DirichletPartitioner` (``"dirichlet"``): for every class, the share each partition gets is
  drawn from ``Dirichlet(alpha)``; small ``alpha`` gives skewed label distributions.
* `ShardPartitioner` (``"shard"``): rows sorted by label are cut into shards that are dealt
  out at random, a few per partition (the McMahan et al. 2017 pathological non-IID split).

Every partitioner returns ``num_partitions`` disjoint, non-empty ``int64`` index arrays that
together cover every row, and the result depends only on the labels, the partition count and
the seed. ``create_partitioner`` builds one from a name and keyword arguments, as read from a
configuration file.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import numpy.typing as npt

from fedps._registry import add_entry
from fedps.errors import ConfigError

__all__ = [
    "DirichletPartitioner",
    "IidPartitioner",
    "Partitioner",
    "ShardPartitioner",
    "create_partitioner",
    "partitioner_names",
    "register_partitioner",
]

_LOG = logging.getLogger("fedps")

IndexArray = npt.NDArray[np.int64]


def _check_int(value: object, what: str, minimum: int) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {int(value)}")
    return int(value)


class Partitioner(ABC):
    """Base class: splits row indices into disjoint, non-empty partitions.

    Subclasses implement `_partition`; `partition` validates the arguments first.
    """

    def partition(
        self, labels: npt.NDArray[np.integer[Any]], num_partitions: int, seed: int
    ) -> list[IndexArray]:
        """Split the indices ``0 .. len(labels) - 1`` into ``num_partitions`` parts.

        Parameters
        ----------
        labels : numpy.ndarray
            1-D integer class labels of the training set, one per row.
        num_partitions : int
            Number of partitions (clients), at least 1.
        seed : int
            Non-negative seed for ``numpy.random.default_rng``; equal inputs and seed give
            equal partitions.

        Returns
        -------
        list of numpy.ndarray
            ``num_partitions`` ``int64`` index arrays, disjoint, non-empty, covering every row.

        Raises
        ------
        ConfigError
            If the arguments are invalid or the split is impossible, e.g. more partitions than
            rows.
        """
        labels = np.asarray(labels)
        if labels.ndim != 1:
            raise ConfigError(f"labels must be a 1-D array, got shape {labels.shape}")
        if labels.size and not np.issubdtype(labels.dtype, np.integer):
            raise ConfigError(f"labels must be integers, got dtype {labels.dtype}")
        num_partitions = _check_int(num_partitions, "num_partitions", 1)
        seed = _check_int(seed, "seed", 0)
        if num_partitions > labels.shape[0]:
            raise ConfigError(
                f"cannot split {labels.shape[0]} samples into {num_partitions} non-empty partitions"
            )
        rng = np.random.default_rng(seed)
        parts = self._partition(labels.astype(np.int64, copy=False), num_partitions, rng)
        return [np.asarray(part, dtype=np.int64) for part in parts]

    @abstractmethod
    def _partition(
        self, labels: IndexArray, num_partitions: int, rng: np.random.Generator
    ) -> list[IndexArray]:
        """Split already validated ``labels`` (``1 <= num_partitions <= len(labels)``)."""

    def __repr__(self) -> str:
        """Show the class name and the constructor arguments."""
        args = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({args})"


class IidPartitioner(Partitioner):
    """Shuffle the rows with the seed and cut them into near-equal parts.

    Partition sizes differ by at most one.
    """

    def _partition(
        self, labels: IndexArray, num_partitions: int, rng: np.random.Generator
    ) -> list[IndexArray]:
        """Cut a seeded permutation of the rows into ``num_partitions`` parts."""
        order = rng.permutation(labels.shape[0]).astype(np.int64)
        return list(np.array_split(order, num_partitions))


class DirichletPartitioner(Partitioner):
    """Label-skewed split: per class, partition shares are drawn from ``Dirichlet(alpha)``.

    The algorithm is that of ``flwr_datasets.partitioner.DirichletPartitioner`` (from Yurochkin
    et al. 2019, "Bayesian Nonparametric Federated Learning of Neural Networks"), with the same
    ``alpha`` for every partition: classes are handled in sorted order; for each one, a
    proportion vector is drawn from ``Dirichlet(alpha, ..., alpha)``; with ``self_balancing``,
    a partition that already holds more than ``len(labels) / num_partitions`` rows gets no
    more; the class's rows are then cut by the cumulative proportions. If some partition ends
    up with fewer than ``min_partition_size`` rows, everything is drawn again, at most
    ``max_attempts`` times in all. Each partition's indices are shuffled at the end.

    Parameters
    ----------
    alpha : float
        Concentration, ``> 0``. Small values (``0.1``) give few classes per partition and
        uneven sizes; large values (``100``) approach an IID split.
    min_partition_size : int, optional
        Smallest acceptable partition, at least 1 (default 10).
    self_balancing : bool, optional
        Stop giving rows to partitions above the average size (default ``True``, as in
        flwr-datasets).
    max_attempts : int, optional
        How many times the whole draw may be made before giving up (default 11: the first
        draw and the 10 resamples flwr-datasets allows).

    Raises
    ------
    ConfigError
        If a parameter is invalid.
    """

    alpha: float
    min_partition_size: int
    self_balancing: bool
    max_attempts: int

    def __init__(
        self,
        alpha: float,
        min_partition_size: int = 10,
        *,
        self_balancing: bool = True,
        max_attempts: int = 11,
    ) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
            raise ConfigError(f"alpha must be a number, got {type(alpha).__name__} {alpha!r}")
        if not (math.isfinite(float(alpha)) and float(alpha) > 0):
            raise ConfigError(f"alpha must be a finite number > 0, got {alpha!r}")
        if not isinstance(self_balancing, bool):
            raise ConfigError(f"self_balancing must be a bool, got {self_balancing!r}")
        self.alpha = float(alpha)
        self.min_partition_size = _check_int(min_partition_size, "min_partition_size", 1)
        self.self_balancing = self_balancing
        self.max_attempts = _check_int(max_attempts, "max_attempts", 1)

    def _partition(
        self, labels: IndexArray, num_partitions: int, rng: np.random.Generator
    ) -> list[IndexArray]:
        """Draw Dirichlet splits until every partition is large enough."""
        num_samples = labels.shape[0]
        if self.min_partition_size * num_partitions > num_samples:
            raise ConfigError(
                f"cannot give each of {num_partitions} partitions at least "
                f"{self.min_partition_size} of {num_samples} samples; lower "
                "min_partition_size or num_partitions"
            )
        for attempt in range(1, self.max_attempts + 1):
            parts = self._draw(labels, num_partitions, rng)
            smallest = min(part.shape[0] for part in parts)
            if smallest >= self.min_partition_size:
                for part in parts:
                    rng.shuffle(part)
                return parts
            _LOG.debug(
                "dirichlet partition attempt %d/%d: smallest partition has %d < %d samples",
                attempt,
                self.max_attempts,
                smallest,
                self.min_partition_size,
            )
        raise ConfigError(
            f"DirichletPartitioner(alpha={self.alpha}) could not give every one of "
            f"{num_partitions} partitions at least {self.min_partition_size} samples in "
            f"{self.max_attempts} attempts; raise alpha or lower min_partition_size"
        )

    def _draw(
        self, labels: IndexArray, num_partitions: int, rng: np.random.Generator
    ) -> list[IndexArray]:
        """Make one Dirichlet assignment of every class's rows to the partitions."""
        average = labels.shape[0] / num_partitions
        sizes = np.zeros(num_partitions, dtype=np.int64)
        chunks: list[list[IndexArray]] = [[] for _ in range(num_partitions)]
        concentration = np.full(num_partitions, self.alpha)
        for label in np.unique(labels):
            members = np.flatnonzero(labels == label).astype(np.int64)
            proportions = rng.dirichlet(concentration)
            if self.self_balancing:
                balanced = np.where(sizes > average, 0.0, proportions)
                total = float(balanced.sum())
                # With tiny alpha every open partition's share can underflow to 0: keep the
                # unbalanced draw rather than divide by zero.
                if total > 0.0:
                    proportions = balanced / total
            cuts = (np.cumsum(proportions) * members.shape[0]).astype(np.int64)[:-1]
            for index, piece in enumerate(np.split(members, cuts)):
                chunks[index].append(piece)
                sizes[index] += piece.shape[0]
        return [np.concatenate(parts).astype(np.int64, copy=False) for parts in chunks]


class ShardPartitioner(Partitioner):
    """Pathological non-IID split: label-sorted shards dealt out at random.

    As ``flwr_datasets.partitioner.ShardPartitioner`` with ``num_shards_per_partition`` given:
    the rows are stably sorted by label and cut into ``num_partitions *
    num_shards_per_partition`` consecutive shards, which a seeded permutation deals out,
    ``num_shards_per_partition`` to each partition. Unlike flwr-datasets (which drops the
    remainder rows when the shard size does not divide the dataset), shard sizes here differ
    by at most one so that every row is used.

    Parameters
    ----------
    num_shards_per_partition : int
        Shards each partition receives, at least 1.

    Raises
    ------
    ConfigError
        If the parameter is invalid.
    """

    num_shards_per_partition: int

    def __init__(self, num_shards_per_partition: int) -> None:
        self.num_shards_per_partition = _check_int(
            num_shards_per_partition, "num_shards_per_partition", 1
        )

    def _partition(
        self, labels: IndexArray, num_partitions: int, rng: np.random.Generator
    ) -> list[IndexArray]:
        """Cut the label-sorted rows into shards and deal them to the partitions."""
        num_shards = num_partitions * self.num_shards_per_partition
        if num_shards > labels.shape[0]:
            raise ConfigError(
                f"cannot cut {labels.shape[0]} samples into {num_shards} non-empty shards "
                f"({num_partitions} partitions x {self.num_shards_per_partition} shards); "
                "lower num_partitions or num_shards_per_partition"
            )
        order = np.argsort(labels, kind="stable").astype(np.int64)
        shards = np.array_split(order, num_shards)
        dealt = rng.permutation(num_shards).reshape(num_partitions, self.num_shards_per_partition)
        parts: list[IndexArray] = []
        for shard_ids in dealt:
            part = np.concatenate([shards[i] for i in shard_ids])
            rng.shuffle(part)
            parts.append(part)
        return parts


_PARTITIONERS: dict[str, type[Partitioner]] = {
    "dirichlet": DirichletPartitioner,
    "iid": IidPartitioner,
    "shard": ShardPartitioner,
}


def partitioner_names() -> list[str]:
    """The registered partitioners' names, sorted."""
    return sorted(_PARTITIONERS)


def register_partitioner(name: str, partitioner: type[Partitioner]) -> None:
    """Make the class ``partitioner`` available to :func:`create_partitioner` as ``name``.

    Its constructor's arguments are the partitioner's keyword arguments.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_PARTITIONERS, name, partitioner, "partitioner")


def create_partitioner(name: str, **kwargs: Any) -> Partitioner:
    """Build a registered partitioner from its name and constructor arguments.

    Parameters
    ----------
    name : str
        ``"iid"``, ``"dirichlet"`` or ``"shard"``.
    **kwargs
        Constructor arguments: none for ``"iid"``; ``alpha`` (required),
        ``min_partition_size``, ``self_balancing``, ``max_attempts`` for ``"dirichlet"``;
        ``num_shards_per_partition`` (required) for ``"shard"``.

    Returns
    -------
    Partitioner
        The configured partitioner.

    Raises
    ------
    ConfigError
        If the name is unknown, an argument is missing or unexpected, or a value is invalid.
    """
    cls = _PARTITIONERS.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown partitioner {name!r}; valid names: {', '.join(sorted(_PARTITIONERS))}"
        )
    signature = inspect.signature(cls)
    accepted = ", ".join(signature.parameters) or "none"
    unknown = sorted(set(kwargs) - set(signature.parameters))
    if unknown:
        raise ConfigError(
            f"unexpected arguments for partitioner {name!r}: {', '.join(unknown)} "
            f"(accepted arguments: {accepted})"
        )
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"bad arguments for partitioner {name!r}: {exc} (accepted arguments: {accepted})"
        ) from None
    return cls(**kwargs)
