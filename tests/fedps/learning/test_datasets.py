"""Tests for fedps.learning.datasets: the offline dataset registry and the IDX parser."""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedps.errors import ConfigError
from fedps.learning.datasets import (
    DEFAULT_FASHION_MNIST_DIR,
    Dataset,
    _split_rows,
    image_shape,
    load_dataset,
)

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801


@pytest.fixture(scope="module")
def digits() -> tuple[Dataset, Dataset]:
    """Load the digits dataset once for the module."""
    return load_dataset("digits")


@pytest.fixture(scope="module")
def mnist5k() -> tuple[Dataset, Dataset]:
    """Load the mnist5k dataset once for the module."""
    return load_dataset("mnist5k")


def _write_idx(
    path: Path, magic: int, array: npt.NDArray[np.uint8], *, size: int | None = None
) -> None:
    """Write ``array`` as an IDX file (gzip-compressed if the name ends in .gz)."""
    header = magic.to_bytes(4, "big") + b"".join(int(dim).to_bytes(4, "big") for dim in array.shape)
    payload = array.astype(np.uint8).tobytes()
    if size is not None:
        payload = payload[:size]
    data = header + payload
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def _write_fashion(
    directory: Path,
    *,
    n_train: int = 12,
    n_test: int = 5,
    gz: bool = True,
    side: int = 28,
    seed: int = 0,
) -> dict[str, npt.NDArray[np.uint8]]:
    """Write a small synthetic Fashion-MNIST directory and return the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, side, side), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, side, side), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    arrays["train-images-idx3-ubyte"][0, 0, 0] = 255  # the maximum is hit somewhere
    for stem, array in arrays.items():
        magic = IMAGES_MAGIC if "images" in stem else LABELS_MAGIC
        _write_idx(directory / (f"{stem}.gz" if gz else stem), magic, array)
    return arrays


# --- registry ----------------------------------------------------------------------------------


def test_unknown_dataset_name_lists_valid_names() -> None:
    # Prepare
    name = "cifar10"

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        load_dataset(name)

    # Assert
    message = str(excinfo.value)
    assert "cifar10" in message
    for valid in ("digits", "fashion_mnist", "mnist5k"):
        assert valid in message
    assert isinstance(excinfo.value, ValueError)


def test_image_shape_unknown_name_raises() -> None:
    # Prepare / Execute
    with pytest.raises(ConfigError, match="valid names"):
        image_shape("nope")


@pytest.mark.parametrize(
    ("name", "shape"),
    [("digits", (1, 8, 8)), ("mnist5k", (1, 28, 28)), ("fashion_mnist", (1, 28, 28))],
)
def test_image_shape(name: str, shape: tuple[int, int, int]) -> None:
    # Prepare / Execute
    found = image_shape(name)

    # Assert
    assert found == shape


# --- Dataset -----------------------------------------------------------------------------------


def test_dataset_validates_and_is_frozen() -> None:
    # Prepare
    x = np.zeros((3, 4), dtype=np.float32)
    y = np.array([0, 1, 2], dtype=np.int64)

    # Execute
    dataset = Dataset(x=x, y=y, num_classes=3, name="toy")

    # Assert
    assert dataset.num_features == 4
    assert len(dataset) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        dataset.name = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="float32"):
        Dataset(x=x.astype(np.float64), y=y, num_classes=3, name="toy")
    with pytest.raises(ValueError, match="int64"):
        Dataset(x=x, y=y.astype(np.int32), num_classes=3, name="toy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows"):
        Dataset(x=x[:2], y=y, num_classes=3, name="toy")
    with pytest.raises(ValueError, match="labels"):
        Dataset(x=x, y=y, num_classes=2, name="toy")


# --- digits and mnist5k ------------------------------------------------------------------------


def _check_split(train: Dataset, test: Dataset, n_train: int, n_test: int, features: int) -> None:
    """Shared assertions for a loaded (train, test) pair of a 10-class image dataset."""
    for part, rows in ((train, n_train), (test, n_test)):
        assert part.x.shape == (rows, features)
        assert part.x.dtype == np.float32
        assert part.y.shape == (rows,)
        assert part.y.dtype == np.int64
        assert part.num_classes == 10
        assert part.num_features == features
        assert float(part.x.min()) == 0.0
        assert float(part.x.max()) == 1.0
        assert set(np.unique(part.y).tolist()) == set(range(10))


def test_digits_shapes_ranges_and_stratification(digits: tuple[Dataset, Dataset]) -> None:
    # Prepare
    train, test = digits

    # Execute
    train_share = np.bincount(train.y, minlength=10) / len(train)
    test_share = np.bincount(test.y, minlength=10) / len(test)

    # Assert
    _check_split(train, test, 1437, 360, 64)
    assert int(np.prod(image_shape("digits"))) == train.num_features
    assert (train.name, test.name) == ("digits/train", "digits/test")
    assert np.abs(train_share - test_share).max() < 0.01


def test_digits_split_is_deterministic(digits: tuple[Dataset, Dataset]) -> None:
    # Prepare
    train, test = digits

    # Execute
    train_again, test_again = load_dataset("digits", data_dir="/ignored")

    # Assert
    np.testing.assert_array_equal(train.x, train_again.x)
    np.testing.assert_array_equal(train.y, train_again.y)
    np.testing.assert_array_equal(test.y, test_again.y)


def test_digits_are_scikit_learns_split_as_it_splits_them(
    digits: tuple[Dataset, Dataset],
) -> None:
    # Prepare: scikit-learn's digits and its stratified 80/20 split with seed 0
    bunch = load_digits()
    x = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)
    y = np.asarray(bunch.target, dtype=np.int64)

    # Execute
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )

    # Assert: the very rows, in the very order (every figure measured on digits holds)
    train, test = digits
    np.testing.assert_array_equal(train.x, x_train)
    np.testing.assert_array_equal(train.y, y_train)
    np.testing.assert_array_equal(test.x, x_test)
    np.testing.assert_array_equal(test.y, y_test)


@given(
    labels=st.lists(st.integers(0, 6), min_size=12, max_size=300),
    test_fraction=st.sampled_from([0.2, 0.25, 1 / 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_split_draws_scikit_learns_rows(
    labels: list[int], test_fraction: float, seed: int
) -> None:
    # Prepare: labels whose every class has two rows at least, as stratification needs
    y = np.array(labels, dtype=np.int64)
    counts = np.bincount(y)
    if counts[counts > 0].min() < 2:
        y = np.concatenate([y, y])
    rows = np.arange(len(y))

    # Execute
    try:
        expected = train_test_split(rows, test_size=test_fraction, stratify=y, random_state=seed)
    except ValueError:  # fewer test (or train) rows than classes: nothing to compare
        return
    train, test = _split_rows(y, test_fraction, seed)

    # Assert
    np.testing.assert_array_equal(train, expected[0])
    np.testing.assert_array_equal(test, expected[1])


def test_mnist5k_shapes_ranges_and_stratification(mnist5k: tuple[Dataset, Dataset]) -> None:
    # Prepare
    train, test = mnist5k

    # Execute
    train_counts = np.bincount(train.y, minlength=10)
    test_counts = np.bincount(test.y, minlength=10)

    # Assert
    _check_split(train, test, 4000, 1000, 784)
    assert int(np.prod(image_shape("mnist5k"))) == train.num_features
    # The file holds 500 images per digit, so a stratified 80/20 split is exact.
    assert train_counts.tolist() == [400] * 10
    assert test_counts.tolist() == [100] * 10
    # Pixels are k / 255 for integers k.
    np.testing.assert_allclose(train.x * 255.0, np.round(train.x * 255.0), atol=1e-3)


def test_mnist5k_images_look_like_digits(mnist5k: tuple[Dataset, Dataset]) -> None:
    # Prepare
    train, _ = mnist5k
    images = train.x.reshape(-1, 28, 28)

    # Execute
    border = np.concatenate([images[:, :2, :], images[:, -2:, :]], axis=1).mean()
    centre = images[:, 8:20, 8:20].mean()

    # Assert: MNIST digits are centred on a blank border (labels not taken from a pixel column).
    assert border < 0.01
    assert centre > 0.2


# --- fashion_mnist: synthetic IDX files --------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_parses_idx_files(tmp_path: Path, gz: bool) -> None:
    # Prepare
    arrays = _write_fashion(tmp_path, gz=gz)

    # Execute
    train, test = load_dataset("fashion_mnist", data_dir=str(tmp_path))

    # Assert
    assert train.x.shape == (12, 784)
    assert test.x.shape == (5, 784)
    assert train.x.dtype == np.float32
    assert train.y.dtype == np.int64
    assert (train.name, test.name) == ("fashion_mnist/train", "fashion_mnist/test")
    np.testing.assert_allclose(
        train.x, arrays["train-images-idx3-ubyte"].reshape(12, 784) / 255.0, rtol=1e-6
    )
    np.testing.assert_allclose(
        test.x, arrays["t10k-images-idx3-ubyte"].reshape(5, 784) / 255.0, rtol=1e-6
    )
    np.testing.assert_array_equal(train.y, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(test.y, arrays["t10k-labels-idx1-ubyte"])
    assert float(train.x.max()) == 1.0


def test_fashion_mnist_missing_directory(tmp_path: Path) -> None:
    # Prepare
    missing = tmp_path / "absent"

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        load_dataset("fashion_mnist", data_dir=str(missing))

    # Assert
    assert "dataset-fashion-mnist" in str(excinfo.value)
    assert "data_dir" in str(excinfo.value)


def test_fashion_mnist_missing_file(tmp_path: Path) -> None:
    # Prepare
    _write_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        load_dataset("fashion_mnist", data_dir=str(tmp_path))

    # Assert
    assert "t10k-labels-idx1-ubyte" in str(excinfo.value)
    assert "dataset-fashion-mnist" in str(excinfo.value)


def test_fashion_mnist_rejects_bad_magic(tmp_path: Path) -> None:
    # Prepare: a labels file where an images file belongs
    arrays = _write_fashion(tmp_path)
    _write_idx(
        tmp_path / "train-images-idx3-ubyte.gz", LABELS_MAGIC, arrays["train-labels-idx1-ubyte"]
    )

    # Execute / Assert
    with pytest.raises(ConfigError, match="magic"):
        load_dataset("fashion_mnist", data_dir=str(tmp_path))


def test_fashion_mnist_rejects_truncated_payload(tmp_path: Path) -> None:
    # Prepare
    arrays = _write_fashion(tmp_path)
    _write_idx(
        tmp_path / "t10k-images-idx3-ubyte.gz",
        IMAGES_MAGIC,
        arrays["t10k-images-idx3-ubyte"],
        size=100,
    )

    # Execute / Assert
    with pytest.raises(ConfigError, match="bytes"):
        load_dataset("fashion_mnist", data_dir=str(tmp_path))


def test_fashion_mnist_rejects_count_mismatch(tmp_path: Path) -> None:
    # Prepare
    _write_fashion(tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", LABELS_MAGIC, np.zeros(3, np.uint8))

    # Execute / Assert
    with pytest.raises(ConfigError, match="labels"):
        load_dataset("fashion_mnist", data_dir=str(tmp_path))


def test_fashion_mnist_rejects_wrong_image_size(tmp_path: Path) -> None:
    # Prepare
    _write_fashion(tmp_path, side=8)

    # Execute / Assert
    with pytest.raises(ConfigError, match="28x28"):
        load_dataset("fashion_mnist", data_dir=str(tmp_path))


# --- fashion_mnist: the real files -------------------------------------------------------------


@pytest.mark.skipif(
    not Path(DEFAULT_FASHION_MNIST_DIR).is_dir(),
    reason=(
        f"{DEFAULT_FASHION_MNIST_DIR} is absent: install Debian's dataset-fashion-mnist "
        "package to run this test on the real Fashion-MNIST files"
    ),
)
def test_fashion_mnist_real_files() -> None:
    # Prepare / Execute
    train, test = load_dataset("fashion_mnist")

    # Assert
    assert train.x.shape == (60000, 784)
    assert test.x.shape == (10000, 784)
    assert float(train.x.min()) == 0.0
    assert float(train.x.max()) == 1.0
    assert np.bincount(train.y, minlength=10).tolist() == [6000] * 10
    assert np.bincount(test.y, minlength=10).tolist() == [1000] * 10
