"""Tests for server.coordinator.task_desk, the long poll: a waiting client's ``GetTask`` is held
until its task changes (``wait_s``), so it learns of a new round or the push phase without
polling; the number of held calls is bounded, and a call that asks for no hold is answered at
once."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from crypto.signing import BlockSigner
from fedps.config import load_config
from fedps.rpc.coordinator_messages import RETRY_AFTER_S, Assignment
from server.coordinator.coordinator import Coordinator
from server.coordinator.task_desk import MAX_HOLD_S
from server.serve import open_coordinator
from tests.in_process_cluster import start_cluster
from tests.waiting import HANG_S, wait_for


@pytest.fixture
def coordinator(tmp_path: Path) -> Coordinator:
    """A coordinator whose rounds never start (its run loop is not running)."""
    config = load_config(None, cluster={"state_dir": str(tmp_path)})
    return open_coordinator(config, tmp_path / "coordinator")


def _register(coordinator: Coordinator, identity: str = "client-0") -> bytes:
    """Register ``identity`` (as mutual TLS proves it); returns its credential."""
    _, credential = coordinator.registry.register(
        "edge-0", 100, coordinator.layout.num_params, BlockSigner().public_key, identity=identity
    )
    return credential


@pytest.mark.parametrize("wait_s", [0.0, -1.0, math.nan])
def test_a_call_without_a_hold_is_answered_at_once(coordinator: Coordinator, wait_s: float) -> None:
    # Prepare
    credential = _register(coordinator)

    # Execute
    task = coordinator.desk.get_task("client-0", credential, wait_s=wait_s)

    # Assert: WAIT, asking the client to come back after the usual pause
    assert task == Assignment("wait", 0, retry_after=RETRY_AFTER_S)


def test_a_held_call_that_sees_no_change_says_to_ask_again_at_once(
    coordinator: Coordinator,
) -> None:
    # Prepare
    credential = _register(coordinator)

    # Execute: held for its whole wait, nothing changes (no round starts here)
    task = coordinator.desk.get_task("client-0", credential, wait_s=0.05)

    # Assert: it waited already, so no pause before the next call
    assert task.kind == "wait"
    assert task.retry_after == 0.0


def test_the_clients_told_the_run_is_done_are_counted_once(coordinator: Coordinator) -> None:
    # Prepare: two clients, the run finished
    credential = _register(coordinator)
    _register(coordinator, "client-1")
    coordinator.finished = True

    # Execute: one of them asks, twice
    tasks = [coordinator.desk.get_task("client-0", credential) for _ in range(2)]

    # Assert: DONE, and one client told so (the other never asked)
    assert {t.kind for t in tasks} == {"done"}
    assert coordinator.desk.told_done == {"client-0"}


def test_calls_beyond_the_bound_are_not_held(coordinator: Coordinator) -> None:
    # Prepare: no call may be held
    coordinator.desk.max_held_calls = 0
    credential = _register(coordinator)

    # Execute
    task = coordinator.desk.get_task("client-0", credential, wait_s=MAX_HOLD_S)

    # Assert: answered at once, with the usual pause
    assert task == Assignment("wait", 0, retry_after=RETRY_AFTER_S)


def test_a_held_call_is_answered_with_the_round_that_opens_meanwhile(tmp_path: Path) -> None:
    # Prepare: a real in-process cluster waiting for its two clients; one has registered
    cluster = start_cluster(tmp_path, training={"clients": 2, "min_quorum": 2, "rounds": 1})
    try:
        coordinator = cluster.coordinator
        credential = _register(coordinator, "client-0")
        answers: list[Assignment] = []

        def wait_for_task() -> None:
            answers.append(coordinator.desk.get_task("client-0", credential, wait_s=MAX_HOLD_S))

        waiter = threading.Thread(target=wait_for_task)
        waiter.start()
        wait_for(lambda: coordinator.desk._held_calls == 1, "client-0's GetTask held")

        # Execute: the second client registers, so the coordinator draws the cohort and
        # opens round 1 while client-0's one call is held
        _register(coordinator, "client-1")
        waiter.join(HANG_S)

        # Assert: that one call carried the round's TRAIN task
        assert not waiter.is_alive(), "the held call never returned"
        assert [(a.kind, a.round) for a in answers] == [("train", 1)]
    finally:
        cluster.stop()


def test_a_member_that_committed_waits_for_the_push_phase_instead_of_training_again(
    tmp_path: Path,
) -> None:
    # Prepare: a real in-process cluster with round 1 open for its two registered clients
    cluster = start_cluster(tmp_path, training={"clients": 2, "min_quorum": 2, "rounds": 1})
    try:
        coordinator = cluster.coordinator
        credential = _register(coordinator, "client-0")
        _register(coordinator, "client-1")
        first = coordinator.desk.get_task("client-0", credential, wait_s=MAX_HOLD_S)
        assert (first.kind, first.round) == ("train", 1)

        # Execute: asked again without and with "I committed to round 1" (nobody has, so the
        # push phase never opens and the second call is held for its whole wait)
        again = coordinator.desk.get_task("client-0", credential)
        committed = coordinator.desk.get_task(
            "client-0", credential, wait_s=0.05, committed_round=1
        )
        other_round = coordinator.desk.get_task("client-0", credential, committed_round=7)

        # Assert: TRAIN again only for a client that did not say it committed to this round
        assert (again.kind, again.round) == ("train", 1)
        assert (committed.kind, committed.retry_after) == ("wait", 0.0)
        assert (other_round.kind, other_round.round) == ("train", 1)
    finally:
        cluster.stop()
