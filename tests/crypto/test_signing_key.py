"""Tests for crypto.signing.BlockSigner.load_or_create: a key file is created once, never
replaced, and a corrupt one is an error naming it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from crypto.files import write_atomic
from crypto.signing import BlockSigner
from fedps.errors import CorruptStateError


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
    # no temporary left; the key's checksum beside it
    assert sorted(p.name for p in path.parent.iterdir()) == ["signing.key", "signing.key.sha256"]


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
    with pytest.raises(CorruptStateError, match=r"signing\.key is corrupt: 5 bytes"):
        BlockSigner.load_or_create(path)


def test_a_key_with_one_bit_flipped_is_refused_and_left_alone(tmp_path: Path) -> None:
    # Prepare: a key of the right length, one bit flipped after it was written
    path = tmp_path / "signing.key"
    BlockSigner.load_or_create(path)
    damaged = bytearray(path.read_bytes())
    damaged[7] ^= 0x10
    path.write_bytes(bytes(damaged))

    # Execute / Assert: the checksum beside it tells; nothing is rewritten
    with pytest.raises(CorruptStateError, match=r"signing\.key is corrupt: .*signing\.key\.sha256"):
        BlockSigner.load_or_create(path)
    assert path.read_bytes() == bytes(damaged)


def test_a_key_written_before_checksums_gets_one(tmp_path: Path) -> None:
    # Prepare: a good key without its checksum file (an older state folder)
    path = tmp_path / "signing.key"
    key = BlockSigner.load_or_create(path).public_key
    (tmp_path / "signing.key.sha256").unlink()

    # Execute
    reloaded = BlockSigner.load_or_create(path).public_key

    # Assert: the same key, and a checksum that now guards it
    assert reloaded == key
    assert (tmp_path / "signing.key.sha256").exists()
