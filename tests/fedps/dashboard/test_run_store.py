"""The dashboard's run store, and the collector that keeps the followed run's progress in it."""

from __future__ import annotations

import dataclasses
import json
import logging
import stat
from pathlib import Path
from typing import Any

import pytest

from fedps.config import FedPSConfig
from fedps.dashboard import RunStore, StatusCollector
from fedps.dashboard.status_collector import Snapshot
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary


def _round(number: int, epsilon: float, accuracy: float = 0.5) -> RoundSummary:
    return RoundSummary(
        round=number,
        version=number,
        contributors=2,
        accuracy=accuracy,
        loss=1.0,
        max_epsilon=epsilon,
        bytes_pushed=1000,
        seconds=2.0,
        abandoned=False,
        push_seconds=0.1,
    )


def _status(rounds: int, *, finished: bool, max_epsilon: float) -> ClusterStatus:
    return ClusterStatus(
        run_id="0123abcd",
        round=rounds,
        version=rounds,
        registered=2,
        finished=finished,
        history=tuple(_round(r, r * 1.0, 0.5 + r / 10) for r in range(1, rounds + 1)),
        max_epsilon=max_epsilon,
        delta=1e-5,
        bytes_pushed=1000 * rounds,
        last_checkpoint_unix=0.0,
        client_epsilons={"c0": max_epsilon, "c1": 1.0},
        client_rounds={"c0": rounds, "c1": 1},
    )


def test_a_record_is_a_private_file_written_atomically(store: RunStore) -> None:
    # Execute
    store.update("1", status="starting", state_dir="/somewhere")
    store.update("1", status="training")

    # Assert: 0600 in a 0700 folder, nothing left beside it, and read back by a new store
    path = store.folder / "1.json"
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in store.folder.iterdir()) == ["1.json"]
    assert json.loads(path.read_text())["status"] == "training"
    reopened = RunStore.open(store.folder).get("1")
    assert reopened is not None
    assert reopened["state_dir"] == "/somewhere"


def test_a_record_is_written_only_when_it_changes(store: RunStore) -> None:
    # Prepare
    store.update("1", status="training")
    serial = store.serial

    # Execute
    store.update("1", status="training")
    unchanged = store.serial
    store.update("1", status="finished")

    # Assert
    assert unchanged == serial
    assert store.serial == serial + 1


def test_progress_never_undoes_the_end_of_a_run(store: RunStore) -> None:
    # Prepare: the operator stopped the run
    store.update("1", status="stopped", ended_unix=10.0)

    # Execute: the collector's last poll comes after
    record = store.progress("1", "training", {}, run={"round": 3})

    # Assert: the progress is kept, the end stays
    assert record["status"] == "stopped"
    assert record["ended_unix"] == 10.0
    assert record["run"] == {"round": 3}


def test_a_run_that_had_not_ended_is_interrupted_when_the_store_opens_again(
    store: RunStore,
) -> None:
    # Prepare
    store.update("1", status="training")
    store.update("2", status="finished")

    # Execute
    reopened = RunStore.open(store.folder)

    # Assert
    assert [r["status"] for r in reopened.summaries() if r["id"] == "1"] == ["interrupted"]
    assert [r["status"] for r in reopened.summaries() if r["id"] == "2"] == ["finished"]


def test_an_unreadable_record_is_left_out_with_a_warning(
    store: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    store.update("1", status="finished")
    (store.folder / "2.json").write_text("{not json")
    (store.folder / "3.json").write_text(json.dumps({"id": "4"}))

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        reopened = RunStore.open(store.folder)

    # Assert
    assert [r["id"] for r in reopened.summaries()] == ["1"]
    assert "2.json" in caplog.text
    assert "3.json" in caplog.text


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a.json", "x" * 65, "run 1"])
def test_a_run_id_names_a_file_in_the_folder_only(store: RunStore, bad: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="not a run id"):
        store.update(bad, status="finished")
    assert store.get(bad) is None


def test_a_status_must_be_known(store: RunStore) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="not a run status"):
        store.update("1", status="done")


def test_the_list_shows_the_latest_run_first_with_its_last_numbers(store: RunStore) -> None:
    # Prepare
    history = [{"round": 1, "accuracy": 0.8}, {"round": 2, "accuracy": None}]
    store.update("1", status="finished", started_unix=100.0)
    store.update("2", status="training", started_unix=200.0, run={"round": 2, "history": history})

    # Execute
    runs = store.summaries()

    # Assert
    assert [r["id"] for r in runs] == ["2", "1"]
    assert runs[0]["accuracy"] == 0.8
    assert runs[0]["round"] == 2
    assert "run" not in runs[0]
    assert runs[1]["accuracy"] is None


def test_only_the_runs_own_model_and_logs_are_files_to_download(
    store: RunStore, tmp_path: Path
) -> None:
    # Prepare: a run's state folder with its model, two logs and its configuration
    state_dir = tmp_path / "runs" / "1"
    (state_dir / "logs").mkdir(parents=True)
    (state_dir / "logs" / "coordinator.log").write_text("round 1\n")
    (state_dir / "logs" / "client-0.log").write_text("trained\n")
    (state_dir / "fedps.toml").write_text("[training]\n")
    (state_dir / "model.pt").write_bytes(b"weights")
    store.update("1", status="finished", state_dir=str(state_dir))
    store.update("2", status="failed")

    # Execute
    files = store.files("1")

    # Assert
    assert files == {"model": True, "logs": ["client-0.log", "coordinator.log"]}
    assert store.model_path("1") == state_dir / "model.pt"
    assert store.log_path("1", "coordinator.log") == state_dir / "logs" / "coordinator.log"
    assert store.log_path("1", "../fedps.toml") is None
    assert store.log_path("1", "nothing.log") is None
    assert store.files("2") == {"model": False, "logs": []}
    assert store.model_path("2") is None


def _polled(collector: StatusCollector, run: dict[str, Any] | None) -> Snapshot:
    """Poll once with ``run`` as the coordinator's view (``None``: it does not answer)."""
    empty = collector._empty()

    def collect(config: FedPSConfig) -> Snapshot:
        return {**empty, "run": run}

    collector._collect = collect  # type: ignore[method-assign]
    return collector.poll_once()


def test_the_collector_keeps_the_followed_run_once_its_cluster_has_stopped(
    config: FedPSConfig, store: RunStore
) -> None:
    # Prepare
    from fedps.dashboard.status_collector import _run_view

    collector = StatusCollector(config, store=store)
    training = {**_run_view(_status(2, finished=False, max_epsilon=2.5)), "rounds": 3}
    finished = {**_run_view(_status(3, finished=True, max_epsilon=3.4)), "rounds": 3}

    # Execute: two rounds, the end, then the coordinator stops
    first = _polled(collector, training)
    second = _polled(collector, finished)
    gone = _polled(collector, None)

    # Assert: a record named after the coordinator's run, training then finished, kept
    assert first["record"]["id"] == "0123abcd"
    assert first["record"]["status"] == "training"
    assert first["record"]["settings"]["rounds"] == config.training.rounds
    assert second["record"]["status"] == "finished"
    assert second["record"]["ended_unix"] >= second["record"]["started_unix"]
    assert gone["run"] is None
    assert gone["record"] == second["record"]
    assert gone["runs_serial"] == store.serial
    # the reports after the last round closed are that round's: the tile and the row agree
    assert gone["record"]["run"]["history"][-1]["max_epsilon"] == 3.4
    assert gone["record"]["run"]["max_epsilon"] == 3.4


def test_a_live_round_keeps_the_epsilon_the_coordinator_recorded(config: FedPSConfig) -> None:
    # Prepare
    from fedps.dashboard.status_collector import _run_view

    # Execute
    view = _run_view(_status(2, finished=False, max_epsilon=2.5))

    # Assert
    assert [r["max_epsilon"] for r in view["history"]] == [1.0, 2.0]


def test_the_tile_and_the_table_show_the_same_rounds_epsilon_while_a_round_is_open(
    config: FedPSConfig, store: RunStore
) -> None:
    # Prepare: two rounds closed, spends of round 3 already reported (2.5)
    from fedps.dashboard.status_collector import _run_view

    collector = StatusCollector(config, store=store)
    starting = {**_run_view(_status(0, finished=False, max_epsilon=0.4)), "rounds": 3}
    training = {**_run_view(_status(2, finished=False, max_epsilon=2.5)), "rounds": 3}

    # Execute: what the page gets
    before = _polled(collector, starting)["record"]["run"]
    shown = _polled(collector, training)["record"]["run"]

    # Assert: the tile is the last row's figure (none before a round closed)
    assert shown["history"][-1]["max_epsilon"] == 2.0
    assert shown["max_epsilon"] == 2.0
    assert before["history"] == [] and before["max_epsilon"] is None


def test_the_collector_writes_into_the_record_the_launcher_named(
    config: FedPSConfig, store: RunStore
) -> None:
    # Prepare: the launcher recorded run 7, then the coordinator of another run answers first
    from fedps.dashboard.status_collector import _run_view

    store.update("7", status="starting", run_id="", started_unix=5.0)
    collector = StatusCollector(config, store=store)
    collector.follow(config, "7")
    view = {**_run_view(_status(1, finished=False, max_epsilon=1.0)), "rounds": 3}
    other = {**view, "run_id": "ffff0000"}

    # Execute
    ours = _polled(collector, view)
    theirs = _polled(collector, other)

    # Assert
    assert ours["record"]["id"] == "7"
    assert ours["record"]["status"] == "training"
    assert ours["record"]["started_unix"] == 5.0
    assert theirs["record"]["run_id"] == "0123abcd"
    assert store.get("ffff0000") is None


def test_the_clients_table_shows_the_servers_figure_the_clients_own_and_the_warnings() -> None:
    # Prepare: the server's ledger says 2.5 for c0, which reports 0.5 and is spent
    from fedps.dashboard.status_collector import _run_view

    status = dataclasses.replace(
        _status(2, finished=False, max_epsilon=2.5),
        client_reported_epsilons={"c0": 0.5, "c1": 1.0},
        privacy_warnings=("c0 registered with epsilon 0.5000, below 2.5000",),
        spent_clients=("c0",),
        flagged_clients=("c0",),
    )

    # Execute
    view = _run_view(status)

    # Assert
    rows = {
        c["id"]: (c["epsilon"], c["reported_epsilon"], c["spent"], c["warned"])
        for c in view["clients"]
    }
    assert rows == {"c0": (2.5, 0.5, True, True), "c1": (1.0, 1.0, False, False)}
    assert view["privacy_warnings"] == list(status.privacy_warnings)
