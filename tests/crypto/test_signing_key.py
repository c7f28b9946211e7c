"""Tests for crypto.signing.BlockSigner.load_or_create: a key file is created once, never
replaced, and a corrupt one is an error naming it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from crypto.files import write_atomic
from crypto.signing import BlockSigner
from fedps.errors import ConfigError


def _public_key(path: Path) -> bytes:
    return BlockSigner.load_or_create(path).public_key


def test_racing_creators_end_with_one_key(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "keys" / "signing.key"

    # Execute: eight processes create the key at once
    with multiprocessing.get_context("fork").Pool(8) as pool:
        keys = pool.map(_public_key, [path] * 8)

    # Assert: every process signs with the key on disk, which is private
    assert set(keys) == {BlockSigner.load_or_create(path).public_key}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in path.parent.iterdir()] == ["signing.key"]  # no temporary left


def test_an_exclusive_write_never_replaces_a_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "key"
    path.write_bytes(b"old")

    # Execute / Assert
    with pytest.raises(FileExistsError):
        write_atomic(path, b"new", exclusive=True)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def test_a_corrupt_key_is_an_error_naming_the_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "signing.key"
    path.write_bytes(b"short")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"signing\.key is corrupt"):
        BlockSigner.load_or_create(path)
