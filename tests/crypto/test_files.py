"""Tests for the atomic-write helpers (crypto/files.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from crypto.files import atomic_writer, write_atomic, write_private


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_replaces_the_content_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "state.bin"
    path.write_bytes(b"old")

    # Execute
    write_atomic(path, b"new")

    # Assert
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_failure_inside_the_block_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(b"old")

    # Execute
    with pytest.raises(RuntimeError, match="disk full"), atomic_writer(path) as fh:
        fh.write(b"half of the new")
        raise RuntimeError("disk full")

    # Assert
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.npz"]


def test_atomic_writer_streams_into_a_new_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "log.bin"

    # Execute
    with atomic_writer(path) as fh:
        fh.write(b"a")
        fh.write(b"b")
        assert not path.exists()  # nothing is visible before the block ends

    # Assert
    assert path.read_bytes() == b"ab"


def test_write_private_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "secret.key"

    # Execute
    write_private(path, b"key")

    # Assert
    assert _mode(path) == 0o600
    assert path.read_bytes() == b"key"


def test_exclusive_write_never_replaces_an_existing_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "challenge.key"
    write_private(path, b"first", exclusive=True)

    # Execute / Assert
    with pytest.raises(FileExistsError):
        write_private(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["challenge.key"]
