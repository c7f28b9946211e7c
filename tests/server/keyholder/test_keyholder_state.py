"""Tests for the key holder's durable state (server/keyholder/keyholder.py): a damaged state
file or a lost key stops it with one line, never a silent start over or a new key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crypto.files import read_checked
from fedps.errors import CorruptStateError
from fedps.transport import create_server
from server.keyholder.keyholder import KeyHolder
from server.serve import add_keyholder
from tests.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

_STATE = "keyholder-state.npz"


def _with_state(tmp_path: Path) -> Cluster:
    """A stopped cluster whose key holder saved a model (version 0)."""
    cluster = start_cluster(tmp_path, coordinator=False)
    cluster.keyholder.initialize(np.arange(3000, dtype=np.float64))
    cluster.stop()
    return cluster


def _restart(cluster: Cluster) -> KeyHolder:
    return add_keyholder(create_server(), cluster.config, cluster.state_dir / "keyholder")


def test_a_first_start_creates_the_keys_and_a_restart_keeps_them(tmp_path: Path) -> None:
    # Prepare
    cluster = _with_state(tmp_path)
    keys = cluster.state_dir / "keyholder" / "keys"

    # Execute
    restarted = _restart(cluster)

    # Assert
    assert (keys / "signing.key").exists() and (keys / "challenge.key").exists()
    assert restarted.signer.public_key == cluster.keyholder.signer.public_key
    np.testing.assert_array_equal(restarted.params, np.arange(3000))


@pytest.mark.parametrize("name", ["signing.key", "challenge.key"])
def test_a_lost_key_is_reported_not_replaced(tmp_path: Path, name: str) -> None:
    # Prepare: a key holder with state, then one of its keys disappears
    cluster = _with_state(tmp_path)
    folder = cluster.state_dir / "keyholder"
    (folder / "keys" / name).unlink()

    # Execute / Assert
    with pytest.raises(CorruptStateError) as info:
        _restart(cluster)
    message = str(info.value)
    assert message.startswith(f"{folder / 'keys' / name} is missing but {folder / _STATE} exists")
    assert "restore it from a backup" in message and "\n" not in message
    assert not (folder / "keys" / name).exists()


def test_a_flipped_bit_in_the_state_file_stops_the_key_holder(tmp_path: Path) -> None:
    # Prepare
    cluster = _with_state(tmp_path)
    path = cluster.state_dir / "keyholder" / _STATE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(data)

    # Execute / Assert
    with pytest.raises(CorruptStateError) as info:
        _restart(cluster)
    assert str(info.value) == (
        f"{path}: the key holder state is corrupt (checksum mismatch); restore {_STATE} from "
        "a backup; without it the run cannot continue (docs/operations.md)"
    )


def test_a_state_file_from_before_the_checked_format_still_loads(tmp_path: Path) -> None:
    # Prepare: the state as an unchecked .npz, as it was written before
    cluster = _with_state(tmp_path)
    path = cluster.state_dir / "keyholder" / _STATE
    payload = read_checked(path, what="state", hint="")
    assert payload is not None
    path.write_bytes(payload)

    # Execute
    restarted = _restart(cluster)

    # Assert
    assert restarted.version == cluster.keyholder.version
    np.testing.assert_array_equal(restarted.params, np.arange(3000))
