"""Tests for fedps.storage.record_log: an append is all or nothing, a torn tail is cut, a corrupt
record stops the reader and is never rewritten."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.files import FAULTS_VARIABLE
from fedps.errors import CorruptStateError, PeerUnavailableError
from fedps.storage.record_log import RecordLog

_RECORDS = [b"opened", b"a push of some length", b"closed"]
_FILE = "round-000000000007.wal"


def _written(directory: Path, records: list[bytes] = _RECORDS) -> Path:
    """A log of ``records`` in round 7 of ``directory``; returns its file."""
    log = RecordLog(directory, fsync=False)
    for record in records:
        log.append(7, record)
    log.close()
    return directory / _FILE


def _read(directory: Path) -> list[bytes]:
    return [payload for _, payload in RecordLog(directory).records()]


def _flip(path: Path, bit: int) -> bytes:
    """Flip one bit of ``path``; returns the damaged content."""
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(data)
    return bytes(data)


def test_a_failed_append_leaves_the_file_as_it_was_and_records_nothing(
    tmp_path: Path, faults: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: two acknowledged records, then a full disk for the next write
    log = RecordLog(tmp_path)
    log.append(7, _RECORDS[0])
    log.append(7, _RECORDS[1])
    before = (tmp_path / _FILE).read_bytes()
    faults.setenv(FAULTS_VARIABLE, "round-*.wal")

    # Execute
    with caplog.at_level(logging.WARNING, "fedps"), pytest.raises(PeerUnavailableError) as info:
        log.append(7, b"x" * 1000)
    after_failure = (tmp_path / _FILE).read_bytes()
    log.append(7, _RECORDS[2])  # the retry: the fault fires once
    log.close()

    # Assert
    assert str(info.value) == (
        f"log {_FILE}: cannot write (No space left on device); nothing was recorded, retry later"
    )
    assert after_failure == before
    assert _read(tmp_path) == _RECORDS
    assert "fault injection is armed" in caplog.text


def test_a_failed_first_append_leaves_an_empty_file(
    tmp_path: Path, faults: pytest.MonkeyPatch
) -> None:
    # Prepare
    faults.setenv(FAULTS_VARIABLE, "other.pb, round-000000000007.wal")
    log = RecordLog(tmp_path)

    # Execute
    with pytest.raises(PeerUnavailableError, match="nothing was recorded"):
        log.append(7, b"x" * 1000)

    # Assert
    assert (tmp_path / _FILE).read_bytes() == b""
    assert _read(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_that_cannot_be_undone_stops_every_later_append(tmp_path: Path) -> None:
    # Prepare: a "file" that is always full and cannot be truncated
    (tmp_path / _FILE).symlink_to("/dev/full")
    log = RecordLog(tmp_path)

    # Execute
    with pytest.raises(PeerUnavailableError) as first:
        log.append(7, b"record")
    with pytest.raises(PeerUnavailableError) as later:
        log.append(8, b"another round")

    # Assert: nothing more lands in any round's file
    assert "until the role restarts" in str(first.value)
    assert str(later.value) == str(first.value)
    assert not (tmp_path / "round-000000000008.wal").exists()


def test_a_log_is_its_owners_alone_whatever_the_umask(tmp_path: Path, loose_umask: None) -> None:
    """The key holder's commit log holds every client's sketches: 0600 in 0700 folders."""
    # Execute
    path = _written(tmp_path / "keyholder" / "commits")

    # Assert
    modes = [p.stat().st_mode & 0o777 for p in (path, path.parent, path.parent.parent)]
    assert modes == [0o600, 0o700, 0o700]


@pytest.mark.parametrize("cut", [1, 5, 8, 9, len(_RECORDS[-1]) + 7])
def test_a_torn_tail_is_cut_and_every_earlier_record_kept(
    tmp_path: Path, cut: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the last record is cut short by ``cut`` bytes (header or payload)
    path = _written(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-cut])

    # Execute
    with caplog.at_level(logging.WARNING, "fedps"):
        records = _read(tmp_path)

    # Assert
    assert records == _RECORDS[:-1]
    assert path.read_bytes() == whole[: len(whole) - 8 - len(_RECORDS[-1])]
    assert f"{path}: cutting a torn last record ({8 + len(_RECORDS[-1]) - cut} bytes" in caplog.text
    assert _read(tmp_path) == _RECORDS[:-1]  # cut once, then clean


@pytest.mark.parametrize(
    ("record", "why"),
    [(1, "checksum mismatch"), (2, "checksum mismatch")],
    ids=["middle", "last"],
)
def test_a_flipped_bit_in_a_complete_record_stops_the_reader_and_keeps_the_file(
    tmp_path: Path, record: int, why: str
) -> None:
    # Prepare: one bit of the payload of a record in the middle, or of the last one
    path = _written(tmp_path)
    offset = sum(8 + len(r) for r in _RECORDS[:record])
    damaged = _flip(path, (offset + 8 + 2) * 8 + 3)

    # Execute
    with pytest.raises(CorruptStateError) as info:
        _read(tmp_path)

    # Assert: one line naming the file and the offset; the evidence kept, nothing rewritten
    message = str(info.value)
    assert message.startswith(f"{path}: corrupt record at byte {offset} ({why}); ")
    assert f"Kept for inspection at {path}.corrupt. To recover: " in message
    assert "\n" not in message
    assert path.read_bytes() == damaged
    assert (tmp_path / f"{_FILE}.corrupt").read_bytes() == damaged


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_any_flipped_bit_is_corruption_never_a_silent_cut(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as folder:
        # Prepare
        directory = Path(folder)
        path = _written(directory)
        bit = data.draw(st.integers(0, path.stat().st_size * 8 - 1))
        damaged = _flip(path, bit)

        # Execute
        with pytest.raises(CorruptStateError, match="corrupt record at byte"):
            _read(directory)

        # Assert
        assert path.read_bytes() == damaged


def test_a_record_whose_length_lost_a_bit_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    # Prepare: the first record's length grows past the end of the file
    path = _written(tmp_path)
    damaged = _flip(path, 6)  # the first length, 6, becomes 70: past the end of the file

    # Execute / Assert
    with pytest.raises(CorruptStateError, match=r"at byte 0 \(damaged length\)"):
        _read(tmp_path)
    assert path.read_bytes() == damaged
