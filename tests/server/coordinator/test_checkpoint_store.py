"""Tests for server.coordinator.checkpoint_store: round trip, atomic replacement, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedps.errors import CorruptStateError
from server.coordinator.checkpoint_store import CHECKPOINT_FILE, CheckpointStore


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    # Prepare
    store = CheckpointStore(tmp_path / "coordinator")
    model = np.arange(5, dtype=np.float64)
    state = {"round": 3, "open": {"deadline": math.inf, "cohort": ["a"]}, "history": []}

    # Execute
    empty = store.load()
    store.save(model, state)
    loaded = store.load()

    # Assert
    assert empty is None
    assert loaded is not None
    np.testing.assert_array_equal(loaded.model, model)
    assert loaded.state == state
    assert loaded.saved_at == store.path.stat().st_mtime
    assert store.path == tmp_path / "coordinator" / CHECKPOINT_FILE


def test_saving_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    # Prepare
    store = CheckpointStore(tmp_path)
    store.save(np.zeros(3), {"round": 1})

    # Execute
    store.save(np.ones(3), {"round": 2})

    # Assert
    loaded = store.load()
    assert loaded is not None and loaded.state == {"round": 2}
    np.testing.assert_array_equal(loaded.model, np.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "is corrupt (truncated: 0 bytes)"),
        (b"not a checkpoint", "is corrupt (not a fedps state file: no FEDPS1 header)"),
        (b"PK\x03\x04truncated", "cannot be read"),  # written before the checked format
    ],
)
def test_an_unreadable_checkpoint_is_a_clear_error(
    tmp_path: Path, content: bytes, why: str
) -> None:
    # Prepare
    store = CheckpointStore(tmp_path)
    store.path.write_bytes(content)

    # Execute / Assert
    with pytest.raises(CorruptStateError) as info:
        store.load()
    assert str(info.value).startswith(f"{store.path}: the coordinator checkpoint {why}")
    assert "move it aside to start the run over" in str(info.value)


def test_a_flipped_bit_in_the_checkpoint_is_detected(tmp_path: Path) -> None:
    # Prepare
    store = CheckpointStore(tmp_path)
    store.save(np.arange(100, dtype=np.float64), {"round": 4})
    damaged = bytearray(store.path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    store.path.write_bytes(damaged)

    # Execute / Assert
    with pytest.raises(CorruptStateError, match=r"corrupt \(checksum mismatch\)"):
        store.load()
    assert store.path.read_bytes() == damaged


def test_a_checkpoint_without_state_is_a_clear_error(tmp_path: Path) -> None:
    # Prepare: an unchecked .npz as written before the checked format, without its state
    store = CheckpointStore(tmp_path)
    with open(store.path, "wb") as fh:
        np.savez(fh, model=np.zeros(2))

    # Execute / Assert
    with pytest.raises(CorruptStateError, match="cannot be read"):
        store.load()


def test_a_checkpoint_from_before_the_checked_format_loads_and_is_rewritten(
    tmp_path: Path,
) -> None:
    # Prepare
    store = CheckpointStore(tmp_path)
    meta = np.frombuffer(json.dumps({"round": 2}).encode(), dtype=np.uint8)
    with open(store.path, "wb") as fh:
        np.savez(fh, model=np.ones(3), meta=meta)

    # Execute
    loaded = store.load()
    assert loaded is not None
    store.save(loaded.model, loaded.state)

    # Assert
    assert loaded.state == {"round": 2}
    assert store.path.read_bytes().startswith(b"FEDPS1\n")
