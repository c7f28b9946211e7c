"""Tests for fedps.storage.state_lock: one holder per state directory, named when another asks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedps.storage.state_lock import LOCK_FILE, StateLock, StateLockedError


def test_a_second_lock_on_a_held_directory_names_the_holder(tmp_path: Path) -> None:
    # Prepare: the directory does not exist yet; the first lock creates it
    directory = tmp_path / "state" / "shard-0"
    first = StateLock(directory)
    first.acquire()

    # Execute
    with pytest.raises(StateLockedError) as refused:
        StateLock(directory).acquire()

    # Assert: the message names the directory and this process, which holds it
    assert str(directory) in str(refused.value)
    assert f"pid {os.getpid()}" in str(refused.value)
    assert (directory / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    first.release()


def test_a_released_lock_can_be_taken_again(tmp_path: Path) -> None:
    # Prepare
    with StateLock(tmp_path) as lock:
        assert lock.held
    # Execute
    again = StateLock(tmp_path)
    again.acquire()
    # Assert: taken; the lock file stays
    assert again.held and not lock.held
    assert (tmp_path / LOCK_FILE).exists()
    again.release()


def test_acquire_twice_and_release_twice_are_harmless(tmp_path: Path) -> None:
    # Prepare
    lock = StateLock(tmp_path)
    # Execute
    lock.acquire()
    lock.acquire()
    lock.release()
    lock.release()
    # Assert
    with StateLock(tmp_path) as other:
        assert other.held


def test_the_lock_file_and_a_new_folder_are_owner_only(tmp_path: Path, loose_umask: None) -> None:
    # Prepare
    directory = tmp_path / "state" / "coordinator"

    # Execute
    with StateLock(directory):
        pass

    # Assert
    modes = [p.stat().st_mode & 0o777 for p in (directory / LOCK_FILE, directory, directory.parent)]
    assert modes == [0o600, 0o700, 0o700]
