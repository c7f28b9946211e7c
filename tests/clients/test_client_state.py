"""Tests for clients.client_state: a privacy ledger that survives restarts, is written
atomically, and refuses (naming the file) to be reset by a corrupt or foreign file."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from clients.client_state import (
    LEDGER_FILE,
    LEDGER_KEY_FILE,
    ROWS_FOLDER,
    SIGNING_KEY_FILE,
    ClientState,
    DataSource,
    data_fingerprint,
    default_state_dir,
)
from clients.dp_trainer import PrivacySpend
from fedps.config import PrivacyConfig, load_config
from fedps.errors import ConfigError, CorruptStateError
from fedps.learning.datasets import Dataset

IDENTITY = "client-3"
DATA = "ab" * 32
PRIVACY = PrivacyConfig(target_epsilon=4.0)
SPEND = PrivacySpend(((1.1, 0.05, 40), (0.9, 0.05, 20)), 2.5, run_id="run-1")


def _recorded(directory: Path) -> ClientState:
    """A state folder with one recorded spend, closed again."""
    state = ClientState.open(directory, identity=IDENTITY)
    state.record(DATA, SPEND, privacy=PRIVACY)
    state.close()
    return state


def _canonical(document: dict[str, object]) -> bytes:
    """The bytes a ledger's checksum covers."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _rewrite(path: Path, change: Callable[[dict[str, object]], None]) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def test_recorded_spend_and_key_come_back_after_a_restart(tmp_path: Path) -> None:
    # Prepare
    first = _recorded(tmp_path / "state")

    # Execute: a new process opens the same folder
    second = ClientState.open(tmp_path / "state", identity=IDENTITY)

    # Assert: the same spend, history exactly, and the same signing key (kept 0600)
    entry = second.spent(DATA, "example")
    assert entry is not None
    assert entry.spend == SPEND
    assert (entry.delta, entry.accountant) == (PRIVACY.delta, PRIVACY.accountant)
    assert second.spent(DATA, "client") is None
    assert second.spent("cd" * 32, "example") is None
    assert second.signer.public_key == first.signer.public_key
    for name in (LEDGER_FILE, SIGNING_KEY_FILE):
        assert oct((tmp_path / "state" / name).stat().st_mode & 0o777) == "0o600"
    second.close()


def test_default_folder_is_per_identity_under_the_cluster_state_dir(tmp_path: Path) -> None:
    # Prepare
    config = load_config(None, cluster={"state_dir": str(tmp_path)})

    # Execute / Assert
    assert default_state_dir(config, IDENTITY) == tmp_path / "clients" / IDENTITY


def test_a_failed_write_leaves_the_ledger_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a recorded spend; then the disk fails while the next record is written
    _recorded(tmp_path / "state")
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    before = (tmp_path / "state" / LEDGER_FILE).read_bytes()

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    more = PrivacySpend(((1.1, 0.05, 80),), 3.5)

    # Execute
    with pytest.raises(OSError, match="No space"):
        state.record(DATA, more, privacy=PRIVACY)
    monkeypatch.undo()

    # Assert: the file and the state in memory still hold the last durable spend, and no
    # temporary file is left beside it
    assert (tmp_path / "state" / LEDGER_FILE).read_bytes() == before
    entry = state.spent(DATA, "example")
    assert entry is not None and entry.spend == SPEND
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        LEDGER_FILE,
        LEDGER_KEY_FILE,
        LEDGER_KEY_FILE + ".sha256",
        "lock",
        SIGNING_KEY_FILE,
        SIGNING_KEY_FILE + ".sha256",
    ]
    state.close()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:40]), "unreadable"),
        (lambda p: p.write_bytes(b"\x00\xff garbage"), "unreadable"),
        (lambda p: p.write_text("[]"), "no checksum"),
        # a flipped digit that still parses: the budget must not silently shrink
        (
            lambda p: _rewrite(p, lambda d: d["entries"][0]["history"][0].__setitem__(2, 4)),  # type: ignore[index]
            "checksum mismatch",
        ),
    ],
    ids=["truncated", "garbage", "not-a-ledger", "edited"],
)
def test_a_corrupt_ledger_is_an_error_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    # Prepare
    _recorded(tmp_path / "state")
    ledger = tmp_path / "state" / LEDGER_FILE
    damage(ledger)
    damaged = ledger.read_bytes()

    # Execute / Assert: refused, naming the file; nothing rewritten
    with pytest.raises(ConfigError, match=reason) as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(ledger) in str(caught.value)
    assert ledger.read_bytes() == damaged


def test_an_invalid_entry_with_a_valid_checksum_is_refused(tmp_path: Path) -> None:
    # Prepare: a ledger whose checksum matches an impossible history (sample rate 2)
    _recorded(tmp_path / "state")
    ledger = tmp_path / "state" / LEDGER_FILE
    document = json.loads(ledger.read_text())
    del document["hmac_sha256"]
    document["entries"][0]["history"] = [[1.0, 2.0, 3]]
    key = (tmp_path / "state" / LEDGER_KEY_FILE).read_bytes()
    document["hmac_sha256"] = hmac.new(key, _canonical(document), hashlib.sha256).hexdigest()
    ledger.write_text(json.dumps(document))

    # Execute / Assert
    with pytest.raises(ConfigError, match="invalid accountant entry") as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(ledger) in str(caught.value)


def test_a_folder_of_another_identity_is_refused(tmp_path: Path) -> None:
    # Prepare
    _recorded(tmp_path / "state")

    # Execute / Assert
    with pytest.raises(ConfigError, match="belongs to client 'client-3', not 'client-4'") as caught:
        ClientState.open(tmp_path / "state", identity="client-4")
    assert str(tmp_path / "state" / LEDGER_FILE) in str(caught.value)


def test_a_lost_ledger_beside_its_key_is_not_replaced(tmp_path: Path) -> None:
    # Prepare: the client ran before (its key is there), its ledger is gone
    _recorded(tmp_path / "state")
    (tmp_path / "state" / LEDGER_FILE).unlink()

    # Execute / Assert: refused rather than a fresh ledger at epsilon 0
    with pytest.raises(ConfigError, match="ledger is lost") as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(tmp_path / "state" / LEDGER_FILE) in str(caught.value)
    assert not (tmp_path / "state" / LEDGER_FILE).exists()


def test_a_corrupt_signing_key_is_an_error_naming_the_file(tmp_path: Path) -> None:
    # Prepare
    _recorded(tmp_path / "state")
    key = tmp_path / "state" / SIGNING_KEY_FILE
    key.write_bytes(b"\x01" * 7)

    # Execute / Assert
    with pytest.raises(CorruptStateError, match="corrupt") as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(key) in str(caught.value)


def test_one_folder_serves_one_process_at_a_time(tmp_path: Path) -> None:
    # Prepare
    first = ClientState.open(tmp_path / "state", identity=IDENTITY)

    # Execute / Assert: a second user is refused while the first holds the folder ...
    with pytest.raises(ConfigError, match="in use by another process"):
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    # ... and gets it once the first let go (a killed process lets go too)
    first.close()
    second = ClientState.open(tmp_path / "state", identity=IDENTITY)
    second.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.record(DATA, SPEND, privacy=PRIVACY)


def test_in_memory_state_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    monkeypatch.chdir(tmp_path)
    state = ClientState.in_memory(IDENTITY)

    # Execute
    state.record(DATA, SPEND, privacy=PRIVACY)

    # Assert
    entry = state.spent(DATA, "example")
    assert entry is not None and entry.spend == SPEND
    assert state.ledger_path is None
    assert list(tmp_path.iterdir()) == []


def test_data_fingerprint_changes_with_any_example_or_label() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    x = rng.random((20, 4)).astype(np.float32)
    y = rng.integers(0, 3, 20).astype(np.int64)
    base = Dataset(x, y, 3, "a")
    relabelled = y.copy()
    relabelled[5] = (relabelled[5] + 1) % 3
    nudged = x.copy()
    nudged[7, 2] += 1e-3

    # Execute
    same = data_fingerprint(Dataset(x.copy(), y.copy(), 3, "another name"))
    others = [
        data_fingerprint(Dataset(x, relabelled, 3, "a")),
        data_fingerprint(Dataset(nudged, y, 3, "a")),
        data_fingerprint(Dataset(x[1:], y[1:], 3, "a")),
    ]

    # Assert
    assert same == data_fingerprint(base)
    assert len({data_fingerprint(base), *others}) == 4


def test_data_fingerprint_is_the_same_for_reordered_rows() -> None:
    # Prepare
    rng = np.random.default_rng(1)
    x = rng.random((30, 4)).astype(np.float32)
    y = rng.integers(0, 3, 30).astype(np.int64)
    order = rng.permutation(30)

    # Execute
    reordered = data_fingerprint(Dataset(x[order], y[order], 3, "b"))
    one_row_less = data_fingerprint(Dataset(x[order][1:], y[order][1:], 3, "b"))

    # Assert
    assert reordered == data_fingerprint(Dataset(x, y, 3, "a"))
    assert one_row_less != reordered


def _plain_sha256_as_before(document: dict[str, object]) -> None:
    """What the previous version wrote: a plain SHA-256 of the content."""
    del document["hmac_sha256"]
    document["format"] = "fedps-client-ledger/1"
    document["sha256"] = hashlib.sha256(_canonical(document)).hexdigest()


def _plain_sha256_in_place_of_the_keyed_one(document: dict[str, object]) -> None:
    del document["hmac_sha256"]
    document["hmac_sha256"] = hashlib.sha256(_canonical(document)).hexdigest()


@pytest.mark.parametrize(
    ("checksum", "reason"),
    [
        (_plain_sha256_as_before, r"plain SHA-256 where .*ledger\.key keys the checksum: edited"),
        (_plain_sha256_in_place_of_the_keyed_one, "checksum mismatch"),
    ],
    ids=["as-the-previous-version", "in-the-keyed-field"],
)
def test_an_edited_ledger_with_a_recomputed_sha256_is_refused(
    tmp_path: Path, checksum: Callable[[dict[str, object]], None], reason: str
) -> None:
    # Prepare: the spend edited down to one step, and the checksum recomputed without the key
    _recorded(tmp_path / "state")
    ledger = tmp_path / "state" / LEDGER_FILE

    def edit(document: dict[str, object]) -> None:
        document["entries"][0]["history"] = [[1.1, 0.05, 1]]  # type: ignore[index]
        checksum(document)

    _rewrite(ledger, edit)
    edited = ledger.read_bytes()

    # Execute / Assert: refused as a damaged ledger is, in one line naming the file
    with pytest.raises(ConfigError, match=reason) as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(ledger) in str(caught.value) and "\n" not in str(caught.value)
    assert ledger.read_bytes() == edited


def test_a_keyed_ledger_whose_key_is_gone_is_refused(tmp_path: Path) -> None:
    # Prepare
    _recorded(tmp_path / "state")
    (tmp_path / "state" / LEDGER_KEY_FILE).unlink()

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"ledger\.key is missing") as caught:
        ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert str(tmp_path / "state" / LEDGER_FILE) in str(caught.value)


def test_a_ledger_of_the_previous_version_is_accepted_once_and_rewritten_keyed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a folder as the previous version left it (plain SHA-256, no ledger key)
    _recorded(tmp_path / "state")
    ledger = tmp_path / "state" / LEDGER_FILE
    _rewrite(ledger, _plain_sha256_as_before)
    for name in (LEDGER_KEY_FILE, LEDGER_KEY_FILE + ".sha256"):
        (tmp_path / "state" / name).unlink()

    # Execute
    with caplog.at_level("WARNING", logger="fedps"):
        state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    state.close()

    # Assert: its spend is kept, the file is keyed now, and the log says so
    entry = state.spent(DATA, "example")
    assert entry is not None and entry.spend == SPEND
    assert "hmac_sha256" in json.loads(ledger.read_text())
    assert oct((tmp_path / "state" / LEDGER_KEY_FILE).stat().st_mode & 0o777) == "0o600"
    assert "unkeyed checksum" in caplog.text and str(ledger) in caplog.text
    reopened = ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert reopened.spent(DATA, "example") == entry
    reopened.close()


def _rows_source(rows: range) -> DataSource:
    x = np.arange(4 * 100, dtype=np.float32).reshape(100, 4)
    y = np.zeros(100, dtype=np.int64)
    picked = list(rows)
    return DataSource.of(Dataset(x[picked], y[picked], 2, "rows"))


def test_entries_overlap_by_their_rows_and_a_lost_rows_file_overlaps_any_data(
    tmp_path: Path,
) -> None:
    # Prepare: spends on rows 0-49 and 50-99, the rows of each kept in the folder
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    low, high = _rows_source(range(50)), _rows_source(range(50, 100))
    for source in (low, high):
        state.remember(source)
        state.record(source.fingerprint, SPEND, privacy=PRIVACY)
    state.close()
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)

    # Execute / Assert: rows 40-59 share rows with both, rows 0-9 with the first only
    assert [e.data for e in state.overlapping(_rows_source(range(40, 60)), "example")] == sorted(
        [low.fingerprint, high.fingerprint]
    )
    assert [e.data for e in state.overlapping(_rows_source(range(10)), "example")] == [
        low.fingerprint
    ]
    assert state.overlapping(_rows_source(range(10)), "client") == []
    state.close()

    # ... and once the second's rows file is lost, it may overlap anything
    (tmp_path / "state" / ROWS_FOLDER / high.fingerprint).unlink()
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    assert len(state.overlapping(_rows_source(range(10)), "example")) == 2
    state.close()


def test_a_changed_rows_file_is_refused_naming_it(tmp_path: Path) -> None:
    # Prepare: the rows of a recorded spend, one row's digest changed (to hide an overlap)
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    source = _rows_source(range(50))
    state.remember(source)
    state.record(source.fingerprint, SPEND, privacy=PRIVACY)
    state.close()
    rows = tmp_path / "state" / ROWS_FOLDER / source.fingerprint
    rows.write_bytes(b"\x00" * 32 + rows.read_bytes()[32:])
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"rows file .* is corrupt") as caught:
        state.overlapping(_rows_source(range(10)), "example")
    assert str(rows) in str(caught.value)
    state.close()


def test_a_folder_killed_while_it_was_created_opens(tmp_path: Path) -> None:
    # Prepare: the ledger key written, then the process killed before the first ledger
    ClientState.open(tmp_path / "state", identity=IDENTITY).close()
    for name in (LEDGER_FILE, SIGNING_KEY_FILE, SIGNING_KEY_FILE + ".sha256"):
        (tmp_path / "state" / name).unlink()
    key = (tmp_path / "state" / LEDGER_KEY_FILE).read_bytes()

    # Execute
    state = ClientState.open(tmp_path / "state", identity=IDENTITY)
    state.record(DATA, SPEND, privacy=PRIVACY)
    state.close()

    # Assert: the key it had is kept, and the ledger written under it reads back
    assert (tmp_path / "state" / LEDGER_KEY_FILE).read_bytes() == key
    reopened = ClientState.open(tmp_path / "state", identity=IDENTITY)
    entry = reopened.spent(DATA, "example")
    assert entry is not None and entry.spend == SPEND
    reopened.close()
