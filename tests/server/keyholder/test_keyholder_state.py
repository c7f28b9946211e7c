"""Tests for the key holder's durable state (server/keyholder/keyholder.py): a damaged state
file or a lost key stops it with one line, never a silent start over or a new key; a rotated
key pair that cannot be written leaves the current one whole and in use."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from crypto import SecretContext
from crypto.files import FAULTS_VARIABLE, read_checked
from crypto.release import releases_per_key
from fedps.errors import CorruptStateError
from fedps.rpc.transport import create_server
from server.keyholder.keyholder import KeyHolder
from server.serve import add_keyholder
from tests.conftest import Cluster, start_cluster
from tests.round_driver import HandClient, RoundDriver

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


# --------------------------------------------------------------------------- key rotation


def _applied_round(cluster: Cluster, round_: int) -> None:
    """Round ``round_`` of three hand-driven clients under the current key, applied."""
    kh = cluster.keyholder
    driver = RoundDriver(cluster.config, kh.keys.public, run_id="state-run")
    clients = [HandClient(f"client-{i}", np.full(3000, 0.01), version=kh.version) for i in range(3)]
    driver.committed_round(round_, kh.version, clients)
    driver.apply(round_, kh.version, clients)


def test_a_new_key_pair_that_cannot_be_written_is_tried_again_next_round(
    tmp_path: Path, faults: pytest.MonkeyPatch
) -> None:
    # Prepare: a new key after every round; the disk is full when the first one is written
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"clients": 3, "min_quorum": 2},
        security={"rotate_every_rounds": 1},
    )
    try:
        kh = cluster.keyholder
        kh.initialize(np.zeros(3000))
        first = kh.context_id
        faults.setenv(FAULTS_VARIABLE, "secret.key.new")

        # Execute / Assert: round 1 applied under the old pair, kept whole
        _applied_round(cluster, 1)
        assert kh.version == 1 and kh.context_id == first
        assert SecretContext.load(cluster.state_dir / "keyholder" / "keys").public.context_id == (
            first
        )
        # Execute / Assert: round 2 rotates
        _applied_round(cluster, 2)
        assert kh.version == 2 and kh.context_id != first
    finally:
        cluster.stop()


@pytest.mark.parametrize("period", [0, 10, 4000])
def test_a_rotation_period_beyond_the_leakage_bound_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, period: int
) -> None:
    # Prepare: a model of two blocks; one key may release releases_per_key() of them
    cluster = start_cluster(tmp_path, coordinator=False, security={"rotate_every_rounds": period})
    try:
        kh = cluster.keyholder
        budget = releases_per_key(kh.keys.public.params, cluster.config.security.flood_bits)

        # Execute
        with caplog.at_level(logging.WARNING, logger="fedps"):
            kh.initialize(np.zeros(3000))

        # Assert: the default and any period within the bound are quiet
        warnings = [
            r.getMessage() for r in caplog.records if "rotate_every_rounds" in r.getMessage()
        ]
        if period * 2 <= budget and period:
            assert warnings == []
        else:
            assert len(warnings) == 1 and f"set it to {budget // 2} or fewer" in warnings[0]
    finally:
        cluster.stop()
