"""Dense bit-packing of unsigned coefficients: the wire format of RLWE ciphertext coefficients.

A ciphertext coefficient reduced modulo ``q < 2**bits`` needs only ``bits`` bits, not the 64 of a
``uint64``; packing ``n`` of them densely takes ``n * bits / 8`` bytes, with no header and no
padding. The caller transmits ``count`` and ``bits`` out of band.

Wire format
-----------
The number of values ``n`` is a multiple of 64; let ``G = n // 64``.

1. View the values as a ``(64, G)`` array ``V``, row-major: value index ``j * G + g`` is at row
   ``j``, column ``g``.
2. Each column ``g`` forms a stream of ``64 * bits`` bits in which value ``V[j, g]`` occupies
   stream bits ``[j * bits, (j + 1) * bits)``, least significant bit first. Word ``w`` of the
   column (``0 <= w < bits``) holds stream bits ``[64 * w, 64 * w + 64)``, stream bit
   ``64 * w + i`` being bit ``i`` (value ``2**i``) of the word. A value may straddle two
   consecutive words; every stream bit belongs to exactly one value, so there are no padding
   bits.
3. The words form a ``(bits, G)`` array ``W`` (word ``w`` of column ``g`` at row ``w``, column
   ``g``), serialised row-major as little-endian ``uint64``: word ``W[w, g]`` is at byte offset
   ``8 * (w * G + g)``. The total is ``8 * bits * G == n * bits / 8`` bytes.

For example, with ``bits = 3`` and ``G = 1`` the 64 values ``v_0 .. v_63`` pack into three
words; word 0 holds ``v_0 | v_1 << 3 | ... | v_20 << 60 | (v_21 & 1) << 63`` and word 1 starts
with ``v_21 >> 1``.

Implementation
--------------
With this layout every numpy operation works on a whole contiguous row of ``G`` values or
words, so packing and unpacking cost about three vectorised operations per row whatever ``n``.
For each ``bits`` a plan is computed once (and cached): for each output word, the value rows
that contribute to it with their shift; for each value row, the word(s) it is read from.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from fedps.errors import InvalidArgumentError

__all__ = ["pack", "pack_rows", "packed_size", "unpack", "unpack_rows"]

_WORD_BITS = 64
_GROUP = 64  # values per column: the value count must be a multiple of this
_WIRE_DTYPE = np.dtype("<u8")
#: Values per column from which many rows are (un)packed side by side, each in its own layout;
#: below it numpy's loops over so short a run cost more than transposing every row into one
#: long run and back (measured at N = 2048: 32 values a column, against 64 for full-form sums).
_SIDE_BY_SIDE = 64
_UINT64 = np.dtype(np.uint64)


class _Contribution(NamedTuple):
    """Value row ``row`` shifted by ``shift`` (left if ``left`` else right) ORs into a word."""

    row: int
    shift: np.uint64
    left: bool


class _Extraction(NamedTuple):
    """How value row ``j`` is read back from the word rows.

    ``value = ((word[first] >> shift) | (word[first + 1] << spill_shift)) & mask``, where the
    second term is present only if ``spills`` and the mask is applied only if ``masked``.
    """

    first: int
    shift: np.uint64
    spills: bool
    spill_shift: np.uint64
    masked: bool


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise InvalidArgumentError(f"bits must be an int, got {type(bits).__name__}")
    if not 1 <= bits <= _WORD_BITS:
        raise InvalidArgumentError(f"bits must be between 1 and {_WORD_BITS}, got {bits}")


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int | np.integer):
        raise InvalidArgumentError(f"count must be an int, got {type(count).__name__}")
    if count < 0 or count % _GROUP:
        raise InvalidArgumentError(
            f"count must be a non-negative multiple of {_GROUP}, got {count}"
        )


def packed_size(count: int, bits: int) -> int:
    """Return the number of bytes that ``count`` values of ``bits`` bits pack into.

    Parameters
    ----------
    count : int
        Number of values, a non-negative multiple of 64.
    bits : int
        Bits per value, between 1 and 64.

    Returns
    -------
    int
        ``count * bits // 8``.

    Raises
    ------
    InvalidArgumentError
        If ``count`` or ``bits`` is out of range.
    """
    _check_bits(bits)
    _check_count(count)
    return int(count) * int(bits) // 8


@functools.cache
def _pack_plan(bits: int) -> tuple[tuple[_Contribution, ...], ...]:
    """For each of the ``bits`` output words, the value rows that contribute to it."""
    plan: list[list[_Contribution]] = [[] for _ in range(bits)]
    for row in range(_GROUP):
        start = row * bits
        word, offset = divmod(start, _WORD_BITS)
        plan[word].append(_Contribution(row, np.uint64(offset), True))
        if offset + bits > _WORD_BITS:
            # The high part of the value spills into the next word.
            plan[word + 1].append(_Contribution(row, np.uint64(_WORD_BITS - offset), False))
    return tuple(tuple(contributions) for contributions in plan)


@functools.cache
def _unpack_plan(bits: int) -> tuple[_Extraction, ...]:
    """For each of the 64 value rows, how to read it back from the word rows."""
    plan: list[_Extraction] = []
    for row in range(_GROUP):
        word, offset = divmod(row * bits, _WORD_BITS)
        spills = offset + bits > _WORD_BITS
        plan.append(
            _Extraction(
                first=word,
                shift=np.uint64(offset),
                spills=spills,
                spill_shift=np.uint64(_WORD_BITS - offset if spills else 0),
                # Without a spill the right shift already clears everything above the value
                # when the value ends exactly at the top of the word.
                masked=spills or offset + bits < _WORD_BITS,
            )
        )
    return tuple(plan)


def pack(values: npt.NDArray[np.uint64], bits: int) -> bytes:
    """Pack unsigned values of ``bits`` bits each densely, in the module's wire format.

    Parameters
    ----------
    values : numpy.ndarray
        One-dimensional ``uint64`` array whose length is a multiple of 64 and whose every value
        is below ``2**bits``.
    bits : int
        Same as :func:`packed_size`.

    Returns
    -------
    bytes
        ``packed_size(len(values), bits)`` bytes.

    Raises
    ------
    InvalidArgumentError
        If ``values`` is not a one-dimensional ``uint64`` array, its length is not a multiple
        of 64, a value is ``2**bits`` or more, or ``bits`` is out of range.
    """
    _check_bits(bits)
    bits = int(bits)
    if not isinstance(values, np.ndarray):
        raise InvalidArgumentError(f"values must be a numpy array, got {type(values).__name__}")
    if values.dtype != _UINT64:
        raise InvalidArgumentError(f"values must have dtype uint64, got {values.dtype}")
    if values.ndim != 1:
        raise InvalidArgumentError(f"values must be one-dimensional, got shape {values.shape}")
    count = values.shape[0]
    if count % _GROUP:
        raise InvalidArgumentError(
            f"the number of values must be a multiple of {_GROUP}, got {count}"
        )
    if count == 0:
        return b""
    if bits < _WORD_BITS:
        largest = int(values.max())
        if largest >> bits:
            raise InvalidArgumentError(
                f"value {largest} does not fit in {bits} bits (must be below {1 << bits})"
            )

    groups = count // _GROUP
    rows = np.ascontiguousarray(values).reshape(_GROUP, groups)
    return _pack_columns(rows, bits).astype(_WIRE_DTYPE, copy=False).tobytes()


def _pack_columns(rows: npt.NDArray[np.uint64], bits: int) -> npt.NDArray[np.uint64]:
    """Pack each column of a (..., 64, M) array of values into a column of ``bits`` words.

    Returns (..., bits, M) words: leading axes (one per block) are packed side by side.
    """
    *lead, _, columns = rows.shape
    words = np.empty((*lead, bits, columns), dtype=_UINT64)
    scratch = np.empty((*lead, columns), dtype=_UINT64)
    for w, contributions in enumerate(_pack_plan(bits)):
        word = words[..., w, :]
        for index, contribution in enumerate(contributions):
            # The first contribution initialises the word; the others are ORed into it.
            shift_op = np.left_shift if contribution.left else np.right_shift
            target = word if index == 0 else scratch
            shift_op(rows[..., contribution.row, :], contribution.shift, out=target)
            if index:
                np.bitwise_or(word, scratch, out=word)
    return words


def _unpack_columns(words: npt.NDArray[np.uint64], bits: int) -> npt.NDArray[np.uint64]:
    """Inverse of :func:`_pack_columns`: (..., bits, M) words to (..., 64, M) values."""
    *lead, _, columns = words.shape
    rows = np.empty((*lead, _GROUP, columns), dtype=_UINT64)
    scratch = np.empty((*lead, columns), dtype=_UINT64)
    mask = np.uint64((1 << bits) - 1)
    for j, extraction in enumerate(_unpack_plan(bits)):
        row = rows[..., j, :]
        np.right_shift(words[..., extraction.first, :], extraction.shift, out=row)
        if extraction.spills:
            np.left_shift(words[..., extraction.first + 1, :], extraction.spill_shift, out=scratch)
            np.bitwise_or(row, scratch, out=row)
        if extraction.masked:
            np.bitwise_and(row, mask, out=row)
    return rows


def pack_rows(values: npt.NDArray[np.uint64], bits: int) -> list[bytes]:
    """Pack each row of a (B, count) array separately; same bytes as :func:`pack` per row.

    All rows are packed in one pass (the per-row layouts are independent columns), so many
    small blocks cost about as much as one large one.
    """
    _check_bits(bits)
    bits = int(bits)
    if values.dtype != _UINT64 or values.ndim != 2 or values.shape[1] % _GROUP:
        raise InvalidArgumentError("values must be a (B, multiple of 64) uint64 array")
    blocks, count = values.shape
    if blocks == 0 or count == 0:
        return [b""] * blocks
    if bits < _WORD_BITS and int(values.max()) >> bits:
        raise InvalidArgumentError(f"a value does not fit in {bits} bits")
    groups = count // _GROUP
    if groups >= _SIDE_BY_SIDE:
        # Block b's values form the (64, groups) array of its own layout: packed side by side.
        words = _pack_columns(values.reshape(blocks, _GROUP, groups), bits)
    else:  # short rows: packed as one long row of every block's, then put back
        columns = values.reshape(blocks, _GROUP, groups).transpose(1, 0, 2).reshape(_GROUP, -1)
        packed = _pack_columns(np.ascontiguousarray(columns), bits)
        words = np.ascontiguousarray(packed.reshape(bits, blocks, groups).transpose(1, 0, 2))
    wire = words.astype(_WIRE_DTYPE, copy=False)
    return [wire[b].tobytes() for b in range(blocks)]


def unpack_rows(data: list[bytes], count: int, bits: int) -> npt.NDArray[np.uint64]:
    """Unpack several packed rows of ``count`` values each into a (B, count) array."""
    expected = packed_size(count, bits)
    count, bits = int(count), int(bits)
    for item in data:
        if len(item) != expected:
            raise InvalidArgumentError(
                f"packed data for {count} values of {bits} bits must be {expected} bytes, "
                f"got {len(item)}"
            )
    blocks = len(data)
    if blocks == 0 or count == 0:
        return np.empty((blocks, count), dtype=_UINT64)
    groups = count // _GROUP
    words = np.frombuffer(b"".join(data), dtype=_WIRE_DTYPE).astype(_UINT64, copy=False)
    if groups >= _SIDE_BY_SIDE:
        # Each block's (bits, groups) words unpack to its (64, groups) values: side by side.
        return _unpack_columns(words.reshape(blocks, bits, groups), bits).reshape(blocks, count)
    # short rows: unpacked as one long row of every block's, then put back
    columns = words.reshape(blocks, bits, groups).transpose(1, 0, 2).reshape(bits, -1)
    rows = _unpack_columns(np.ascontiguousarray(columns), bits)
    return np.ascontiguousarray(
        rows.reshape(_GROUP, blocks, groups).transpose(1, 0, 2).reshape(blocks, count)
    )


def unpack(data: bytes | memoryview, count: int, bits: int) -> npt.NDArray[np.uint64]:
    """Unpack ``count`` values of ``bits`` bits each from the module's wire format.

    Parameters
    ----------
    data : bytes or memoryview
        Exactly ``packed_size(count, bits)`` bytes, as produced by :func:`pack`. A memoryview
        must be C-contiguous.
    count, bits : int
        Same as :func:`packed_size`.

    Returns
    -------
    numpy.ndarray
        A new, writable one-dimensional ``uint64`` array of ``count`` values, each below
        ``2**bits``.

    Raises
    ------
    InvalidArgumentError
        If ``data`` does not have exactly ``packed_size(count, bits)`` bytes, is not
        contiguous, or ``count`` or ``bits`` is out of range.
    """
    expected = packed_size(count, bits)
    count, bits = int(count), int(bits)
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidArgumentError("packed data must be contiguous")
    if view.nbytes != expected:
        raise InvalidArgumentError(
            f"packed data for {count} values of {bits} bits must be {expected} bytes, "
            f"got {view.nbytes}"
        )
    if count == 0:
        return np.empty(0, dtype=_UINT64)

    groups = count // _GROUP
    words = np.frombuffer(view.cast("B"), dtype=_WIRE_DTYPE).reshape(bits, groups)
    if words.dtype != _UINT64:  # big-endian host: convert to native order once
        words = words.astype(_UINT64)
    return _unpack_columns(words, bits).reshape(count)
