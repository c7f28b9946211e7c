"""Tests for the atomic-write helpers (crypto/files.py)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.files import (
    FAULTS_VARIABLE,
    atomic_writer,
    private_directory,
    private_opener,
    read_checked,
    write_all,
    write_atomic,
    write_checked,
    write_private,
)
from fedps.errors import CorruptStateError

_PAYLOAD = bytes(range(256)) * 3
_HINT = "delete it; it is fetched again"


def _read(path: Path) -> bytes | None:
    return read_checked(path, what="the test state", hint=_HINT)


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


def test_every_atomic_write_is_owner_only_whatever_the_umask(
    tmp_path: Path, loose_umask: None
) -> None:
    # Prepare: one file written before the rule, readable by everyone
    old = tmp_path / "checkpoint.npz"
    old.write_bytes(b"old")
    old.chmod(0o644)

    # Execute
    write_atomic(tmp_path / "ledger.json", b"{}")
    write_checked(old, _PAYLOAD)
    with atomic_writer(tmp_path / "model.pb") as fh:
        fh.write(b"model")
        written_while_open = _mode(next(tmp_path.glob(".model.pb.*.tmp")))

    # Assert: 0600 from the start, and a replaced file is too
    assert written_while_open == 0o600
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {
        "checkpoint.npz": 0o600,
        "ledger.json": 0o600,
        "model.pb": 0o600,
    }


def test_private_directory_creates_every_missing_folder_owner_only(
    tmp_path: Path, loose_umask: None
) -> None:
    # Prepare
    path = tmp_path / "state" / "keyholder" / "commits"

    # Execute
    made = private_directory(path)

    # Assert: every folder it made is 0700; the one that existed is left as it was
    assert made == path
    assert [_mode(p) for p in (path, path.parent, path.parent.parent)] == [0o700] * 3
    assert _mode(tmp_path) == 0o700  # pytest's own
    assert private_directory(path) == path  # and again: nothing to do


def test_private_directory_makes_an_existing_folder_private_but_not_the_ones_above(
    tmp_path: Path,
) -> None:
    # Prepare: folders made before the rule, readable by everyone
    above = tmp_path / "srv"
    path = above / "fedps-state"
    path.mkdir(parents=True)
    for folder in (above, path):
        folder.chmod(0o755)

    # Execute
    private_directory(path)

    # Assert
    assert _mode(path) == 0o700
    assert _mode(above) == 0o755


def test_private_directory_refuses_a_file_in_its_place(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "state"
    path.write_bytes(b"not a folder")

    # Execute / Assert
    with pytest.raises(FileExistsError):
        private_directory(path / "keyholder")
    with pytest.raises(FileExistsError):
        private_directory(path)
    assert _mode(path) != 0o700


def test_private_opener_creates_owner_only_files_and_makes_old_ones_so(
    tmp_path: Path, loose_umask: None
) -> None:
    # Prepare: a log written before the rule, readable by everyone
    new, old = tmp_path / "keyholder.log", tmp_path / "shard-0.log"
    old.write_bytes(b"first\n")
    old.chmod(0o644)

    # Execute: appended to as a role's log is, and opened for a descriptor as a lock is
    for path in (new, old):
        with open(path, "ab", buffering=0, opener=private_opener) as fh:
            fh.write(b"next\n")
    fd = private_opener(tmp_path / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    os.close(fd)

    # Assert: 0600 every one, and the old log kept what it held
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {
        "keyholder.log": 0o600,
        "shard-0.log": 0o600,
        ".lock": 0o600,
    }
    assert old.read_bytes() == b"first\nnext\n"


def test_exclusive_write_never_replaces_an_existing_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "challenge.key"
    write_private(path, b"first", exclusive=True)

    # Execute / Assert
    with pytest.raises(FileExistsError):
        write_private(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["challenge.key"]


def test_a_checked_file_round_trips_and_a_missing_one_is_none(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "model.pb"

    # Execute
    missing = _read(path)
    write_checked(path, _PAYLOAD)

    # Assert
    assert missing is None
    assert _read(path) == _PAYLOAD
    assert _mode(path) == 0o600


@settings(deadline=None, max_examples=80)
@given(st.data())
def test_any_flipped_bit_of_a_checked_file_is_detected(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as folder:
        # Prepare
        path = Path(folder) / "model.pb"
        write_checked(path, _PAYLOAD)
        damaged = bytearray(path.read_bytes())
        bit = data.draw(st.integers(0, len(damaged) * 8 - 1))
        damaged[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(damaged)

        # Execute / Assert: one line naming the file, the damage and the hint
        with pytest.raises(CorruptStateError) as info:
            _read(path)
        message = str(info.value)
        assert message.startswith(f"{path}: the test state is corrupt (")
        assert message.endswith(f"); {_HINT}") and "\n" not in message


@pytest.mark.parametrize(
    ("keep", "why"),
    [
        (0, "truncated: 0 bytes"),
        (3, "truncated: 3 bytes"),
        (20, "truncated: 20 bytes, shorter than its header"),
        (100, f"truncated: 53 of {len(_PAYLOAD)} bytes"),
    ],
)
def test_a_truncated_checked_file_is_detected(tmp_path: Path, keep: int, why: str) -> None:
    # Prepare
    path = tmp_path / "coordinator-checkpoint.npz"
    write_checked(path, _PAYLOAD)
    path.write_bytes(path.read_bytes()[:keep])

    # Execute / Assert
    with pytest.raises(CorruptStateError, match=rf"is corrupt \({why}\); "):
        _read(path)


def test_a_file_without_the_header_is_refused_unless_its_old_format_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a file written before the checked format
    path = tmp_path / "keyholder-state.npz"
    path.write_bytes(b"PK\x03\x04 an old npz")

    # Execute
    with pytest.raises(CorruptStateError, match="not a fedps state file"):
        _read(path)
    with caplog.at_level(logging.WARNING, "fedps"):
        legacy = read_checked(path, what="state", hint=_HINT, legacy_prefix=b"PK\x03\x04")

    # Assert
    assert legacy == b"PK\x03\x04 an old npz"
    assert "has no checksum" in caplog.text


def test_an_armed_fault_fails_the_first_write_once_and_leaves_the_target(
    tmp_path: Path, faults: pytest.MonkeyPatch
) -> None:
    # Prepare
    path = tmp_path / "model.pb"
    write_checked(path, b"old")
    faults.setenv(FAULTS_VARIABLE, "*.ctx,model.*")

    # Execute
    with pytest.raises(OSError) as info:
        write_checked(path, _PAYLOAD)
    after_failure = _read(path)
    write_atomic(tmp_path / "other.bin", b"unmatched")
    write_checked(path, _PAYLOAD)  # a pattern fires once per process

    # Assert
    assert info.value.errno == errno.ENOSPC
    assert after_failure == b"old"
    assert _read(path) == _PAYLOAD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pb", "other.bin"]


def test_an_armed_fault_writes_about_half_of_the_bytes(
    tmp_path: Path, faults: pytest.MonkeyPatch
) -> None:
    # Prepare
    path = tmp_path / "blocks.bin"
    faults.setenv(FAULTS_VARIABLE, "blocks.bin")

    # Execute
    with open(path, "wb") as fh, pytest.raises(OSError, match="No space left on device"):
        write_all(fh, path, b"a" * 10, b"b" * 10)

    # Assert
    assert path.read_bytes() == b"a" * 10


def test_a_fault_at_n_fails_exactly_the_nth_matching_writes(
    tmp_path: Path, faults: pytest.MonkeyPatch
) -> None:
    # Prepare: the 2nd and 4th writes of model.pb fail
    path = tmp_path / "model.pb"
    faults.setenv(FAULTS_VARIABLE, "model.pb@2,model.pb@4")

    # Execute
    failed: list[int] = []
    for n in range(1, 7):
        write_atomic(tmp_path / "other.bin", b"unmatched")  # never counted
        try:
            write_checked(path, bytes([n]))
        except OSError:
            failed.append(n)

    # Assert
    assert failed == [2, 4]
    assert _read(path) == bytes([6])
