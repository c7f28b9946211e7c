"""Tests for server.coordinator.privacy_ledger: what the server knows each identity released."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fedps.config import PrivacyConfig, TrainingConfig
from fedps.errors import CorruptStateError, FedPSError
from fedps.learning.accounting import epsilon, epsilon_of_history
from fedps.storage.record_log import RecordLog
from server.coordinator.checkpoint_store import CHECKPOINT_FILE
from server.coordinator.privacy_ledger import (
    LEDGER_DIR,
    Declaration,
    PrivacyLedger,
    start_new_ledger,
)

pytestmark = pytest.mark.privacy

DELTA = 1e-5
A = Declaration("source-a", 1.1, 0.05, 20)
B = Declaration("source-b", 1.3, 0.1, 10)
_EXAMPLE = PrivacyConfig(noise_multiplier=1.0, target_epsilon=None, delta=DELTA)


def _ledger(state_dir: Path, privacy: PrivacyConfig = _EXAMPLE) -> PrivacyLedger:
    return PrivacyLedger.open(state_dir, privacy=privacy, training=TrainingConfig(), fsync=False)


def _released(
    ledger: PrivacyLedger, round_: int, who: dict[str, Declaration], run_id: str = "run-1"
) -> None:
    ledger.record_round(run_id, round_, contributors=who, members=who)


def test_an_identity_composes_every_round_released_with_it_over_its_sources(
    tmp_path: Path,
) -> None:
    # Prepare
    ledger = _ledger(tmp_path)

    # Execute: client-0 on source A, then B, then A again; client-1 in one round
    _released(ledger, 1, {"client-0": A, "client-1": A})
    _released(ledger, 2, {"client-0": B})
    _released(ledger, 3, {"client-0": A})

    # Assert: all of client-0's rounds are composed (the server cannot know A and B disjoint)
    history = [(1.1, 0.05, 20), (1.3, 0.1, 10), (1.1, 0.05, 20)]
    assert ledger.epsilon("client-0") == epsilon_of_history(history, DELTA)
    assert ledger.epsilon("client-1") == epsilon(1.1, 0.05, 20, DELTA)
    assert ledger.sources("client-0") == {
        "source-a": epsilon(1.1, 0.05, 40, DELTA),
        "source-b": epsilon(1.3, 0.1, 10, DELTA),
    }
    assert ledger.epsilons() == {
        "client-0": ledger.epsilon("client-0"),
        "client-1": ledger.epsilon("client-1"),
    }
    assert ledger.epsilon("client-2") == 0.0


def test_the_ledger_is_replayed_after_a_restart_and_a_round_is_recorded_once(
    tmp_path: Path,
) -> None:
    # Prepare
    ledger = _ledger(tmp_path)
    _released(ledger, 1, {"client-0": A})
    _released(ledger, 2, {"client-0": A})
    ledger.note_key("client-0", "ab" * 32)
    before = ledger.epsilon("client-0")
    ledger.close()

    # Execute: a new coordinator process, and a round applied before the restart asked again
    again = _ledger(tmp_path)
    _released(again, 2, {"client-0": A})

    # Assert
    assert again.epsilon("client-0") == before == epsilon(1.1, 0.05, 40, DELTA)
    assert again.recorded("run-1", 2) and not again.recorded("run-2", 2)
    assert again.note_key("client-0", "ab" * 32) is None  # the same key, remembered
    assert again.note_key("client-0", "cd" * 32) == "ab" * 32
    assert (tmp_path / LEDGER_DIR).stat().st_mode & 0o777 == 0o700


def test_a_new_run_continues_each_identity_ledger(tmp_path: Path) -> None:
    # Prepare
    ledger = _ledger(tmp_path)
    _released(ledger, 1, {"client-0": A})
    ledger.close()

    # Execute: a new run (another run id) in the same state folder, round numbers again from 1
    again = _ledger(tmp_path)
    _released(again, 1, {"client-0": A}, run_id="run-2")

    # Assert
    assert again.epsilon("client-0") == epsilon(1.1, 0.05, 40, DELTA)


def test_a_new_ledger_sets_the_old_one_aside_between_runs_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    ledger = _ledger(tmp_path)
    _released(ledger, 1, {"client-0": A})
    ledger.close()
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"a run in progress")

    # Execute
    with pytest.raises(FedPSError, match="run is in progress"):
        start_new_ledger(tmp_path)
    (tmp_path / CHECKPOINT_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="fedps"):
        aside = start_new_ledger(tmp_path)
    fresh = _ledger(tmp_path)

    # Assert
    assert aside is not None and aside.is_dir()
    assert "a new privacy ledger starts" in caplog.text
    assert fresh.epsilon("client-0") == 0.0
    assert start_new_ledger(tmp_path) is None  # nothing recorded in the fresh one


def test_client_level_counts_every_global_round_for_every_registered_identity(
    tmp_path: Path,
) -> None:
    # Prepare: the run's sigma 2.0, q 0.5 per global round
    privacy = PrivacyConfig(level="client", noise_multiplier=2.0, target_epsilon=None, delta=DELTA)
    log = RecordLog(tmp_path, fsync=False)
    ledger = PrivacyLedger(log, privacy=privacy, client_step=(2.0, 0.5))
    members = {"client-0": A, "client-1": Declaration()}

    # Execute: round 1 released with client-0 only (more noise than accounted), round 2
    # skipped, round 3 released with less noise than accounted; client-2 registers for round 3
    ledger.record_round(
        "run", 1, contributors={"client-0": A}, members=members, noise_multiplier=2.5
    )
    ledger.record_round("run", 2, contributors={}, members=members)
    members["client-2"] = Declaration()
    ledger.record_round("run", 3, contributors={}, members=members, noise_multiplier=1.5)

    # Assert: drawn or not, released or not; sigma the smaller of the accounted and released
    expected = epsilon_of_history([(2.0, 0.5, 2), (1.5, 0.5, 1)], DELTA)
    assert ledger.epsilon("client-0") == ledger.epsilon("client-1") == expected
    assert ledger.epsilon("client-2") == epsilon(1.5, 0.5, 1, DELTA)


def test_an_identity_is_spent_once_one_more_round_passes_the_target(tmp_path: Path) -> None:
    # Prepare: a target that two rounds of A stay under and three do not
    target = (epsilon(1.1, 0.05, 40, DELTA) + epsilon(1.1, 0.05, 60, DELTA)) / 2
    ledger = _ledger(tmp_path, PrivacyConfig(target_epsilon=target, delta=DELTA))

    # Execute / Assert
    assert not ledger.spent_out("client-0", A)  # nothing recorded
    _released(ledger, 1, {"client-0": A})
    assert not ledger.spent_out("client-0", A)
    _released(ledger, 2, {"client-0": A})
    assert ledger.spent_out("client-0", A)
    assert ledger.spent_out("client-0", Declaration())  # undeclared: its last round's
    assert not ledger.spent_out("client-1", A)


def test_a_client_below_the_server_figure_is_warned_about_once_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    ledger = _ledger(tmp_path)
    for round_ in (1, 2, 3):
        _released(ledger, round_, {"client-0": A})
    honest = ledger.epsilon("client-0")

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        ledger.second_opinion("client-0", honest)
        ledger.second_opinion("client-0", 0.0, when="registered with")
        ledger.second_opinion("client-0", 0.1)  # the same server figure: said already
        _released(ledger, 4, {"client-0": A})
        ledger.second_opinion("client-0", 0.2)

    # Assert: two warnings, each naming the client with both figures
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("client-0 registered with epsilon 0.0000, below ")
    assert f"below {epsilon(1.1, 0.05, 40, DELTA):.4f}" in lines[0]  # its last round aside
    assert lines[1].startswith("client-0 reports epsilon 0.2000")
    assert ledger.warned() == (lines, ["client-0"])


def test_a_damaged_ledger_stops_the_coordinator(tmp_path: Path) -> None:
    # Prepare
    ledger = _ledger(tmp_path)
    _released(ledger, 1, {"client-0": A})
    ledger.close()
    (path,) = (tmp_path / LEDGER_DIR).glob("*.wal")
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))

    # Execute / Assert
    with pytest.raises(CorruptStateError, match="restore the ledger from a backup"):
        _ledger(tmp_path)
