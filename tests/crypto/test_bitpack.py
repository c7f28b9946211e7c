"""Tests for crypto.bitpack: round trips, the pinned wire layout, sizes and rejections."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from crypto.bitpack import pack, pack_rows, packed_size, unpack, unpack_rows
from fedps.errors import InvalidArgumentError


def _reference_pack(values: npt.NDArray[np.uint64], bits: int) -> bytes:
    """Pack bit by bit with Python ints, following the module docstring literally."""
    groups = len(values) // 64
    table = values.reshape(64, groups)
    streams = [sum(int(table[j, g]) << (j * bits) for j in range(64)) for g in range(groups)]
    return b"".join(
        ((streams[g] >> (64 * w)) & (2**64 - 1)).to_bytes(8, "little")
        for w in range(bits)
        for g in range(groups)
    )


@st.composite
def _packable(draw: st.DrawFn) -> tuple[npt.NDArray[np.uint64], int]:
    bits = draw(st.integers(1, 64))
    groups = draw(st.integers(1, 8))
    values = draw(arrays(np.uint64, 64 * groups, elements=st.integers(0, 2**bits - 1)))
    return values, bits


@given(_packable())
def test_round_trip(case: tuple[npt.NDArray[np.uint64], int]) -> None:
    # Prepare
    values, bits = case

    # Execute
    data = pack(values, bits)
    restored = unpack(data, len(values), bits)

    # Assert
    assert restored.dtype == np.uint64
    np.testing.assert_array_equal(restored, values)


@given(_packable())
def test_pack_matches_reference_layout(case: tuple[npt.NDArray[np.uint64], int]) -> None:
    # Prepare
    values, bits = case

    # Execute
    data = pack(values, bits)

    # Assert
    assert data == _reference_pack(values, bits)


@given(st.integers(1, 64), st.integers(1, 8))
def test_round_trip_of_all_ones(bits: int, groups: int) -> None:
    # Prepare: the largest value everywhere exercises every bit, masks and spills.
    values = np.full(64 * groups, 2**bits - 1, dtype=np.uint64)

    # Execute
    restored = unpack(pack(values, bits), len(values), bits)

    # Assert
    np.testing.assert_array_equal(restored, values)


def test_known_answer_single_column() -> None:
    # Prepare: 3-bit values 0..7 repeated; eight of them form the 24-bit chunk 0o76543210.
    values = np.arange(64, dtype=np.uint64) % 8

    # Execute
    data = pack(values, 3)

    # Assert
    assert data == bytes.fromhex("88c6fa") * 8
    np.testing.assert_array_equal(unpack(data, 64, 3), values)


def test_known_answer_two_columns() -> None:
    # Prepare: with G = 2, value j * 2 + g sits at row j, column g; at 32 bits word w of
    # column g holds rows 2w and 2w + 1, and words are written row-major (w, then g).
    values = np.arange(128, dtype=np.uint64)

    # Execute
    data = pack(values, 32)

    # Assert
    halves = np.frombuffer(data, dtype="<u4")
    assert halves[:8].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert halves.tolist() == [4 * k + p for k in range(32) for p in (0, 2, 1, 3)]


@pytest.mark.parametrize(
    ("count", "bits", "size"),
    [(0, 45, 0), (64, 1, 8), (64, 3, 24), (128, 45, 720), (409_600, 45, 2_304_000), (64, 64, 512)],
)
def test_packed_size(count: int, bits: int, size: int) -> None:
    # Prepare
    values = np.zeros(count, dtype=np.uint64)

    # Execute
    data = pack(values, bits)

    # Assert
    assert packed_size(count, bits) == size
    assert len(data) == size


@pytest.mark.parametrize("delta", [-8, -1, 1, 8])
def test_unpack_rejects_wrong_length(delta: int) -> None:
    # Prepare
    data = pack(np.ones(128, dtype=np.uint64), 45)
    wrong = data + b"\0" * delta if delta > 0 else data[:delta]

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="must be 720 bytes"):
        unpack(wrong, 128, 45)


@pytest.mark.parametrize(("count", "bits"), [(65, 45), (-64, 45), (64, 0), (64, 65)])
def test_unpack_rejects_bad_count_or_bits(count: int, bits: int) -> None:
    # Prepare
    data = b"\0" * 360

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        unpack(data, count, bits)


@pytest.mark.parametrize("bits", [1, 13, 45, 63])
def test_pack_rejects_value_too_large(bits: int) -> None:
    # Prepare
    values = np.zeros(128, dtype=np.uint64)
    values[77] = 2**bits

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=f"does not fit in {bits} bits"):
        pack(values, bits)


@pytest.mark.parametrize(
    "values",
    [
        np.zeros(64, dtype=np.int64),
        np.zeros(64, dtype=np.uint32),
        np.zeros(64, dtype=">u8"),
        np.zeros((2, 64), dtype=np.uint64),
        np.zeros(65, dtype=np.uint64),
        np.zeros(63, dtype=np.uint64),
    ],
    ids=["int64", "uint32", "big-endian", "2-d", "65", "63"],
)
def test_pack_rejects_bad_arrays(values: npt.NDArray[np.uint64]) -> None:
    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        pack(values, 8)


@pytest.mark.parametrize("bits", [0, 65, -1])
def test_pack_rejects_bad_bits(bits: int) -> None:
    # Prepare
    values = np.zeros(64, dtype=np.uint64)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="bits must be between 1 and 64"):
        pack(values, bits)


def test_unpack_accepts_unaligned_memoryview_and_returns_own_array() -> None:
    # Prepare: the packed bytes start at an odd offset of a larger buffer.
    values = np.arange(192, dtype=np.uint64) * 12_345
    buffer = bytearray(b"x" + pack(values, 45) + b"y")
    view = memoryview(buffer)[1:-1]

    # Execute
    restored = unpack(view, 192, 45)
    buffer[1:-1] = bytes(len(buffer) - 2)

    # Assert: the result neither aliases the buffer nor is read-only.
    np.testing.assert_array_equal(restored, values)
    restored[0] = 1
    assert restored.flags.writeable


def test_pack_accepts_strided_input() -> None:
    # Prepare
    base = np.arange(256, dtype=np.uint64)
    values = base[::2]

    # Execute
    data = pack(values, 9)

    # Assert
    assert data == pack(values.copy(), 9)
    np.testing.assert_array_equal(unpack(data, 128, 9), values)


@pytest.mark.parametrize("count", [64 * 32, 64 * 64, 64 * 65])  # transposed, side by side
def test_many_rows_pack_as_each_row_alone_on_both_layouts(count: int) -> None:
    # Prepare
    values = np.random.default_rng(count).integers(0, 1 << 46, size=(5, count), dtype=np.uint64)
    # Execute
    packed = pack_rows(values, 46)
    # Assert
    assert packed == [pack(row, 46) for row in values]
    np.testing.assert_array_equal(unpack_rows(packed, count, 46), values)
