"""Tests for server.coordinator.ring_keeper: when a shard is declared gone, and what is kept."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fedps.errors import ConfigError, CorruptStateError, FedPSError
from fedps.sharding.ring_view import RingView
from server.coordinator.ring_keeper import RING_FILE, RingKeeper

SHARDS = ["shard-0", "shard-1", "shard-2"]


class Clock:
    """Monotonic seconds that a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_shard_silent_for_gone_after_s_is_removed() -> None:
    # Prepare
    clock = Clock()
    keeper = RingKeeper(SHARDS, gone_after_s=5.0, clock=clock)

    # Execute: silent 4 s, answers, then silent 5 s
    first = keeper.unreachable("shard-1")
    clock.now += 4.0
    second = keeper.unreachable("shard-1")
    keeper.answered("shard-1")
    clock.now += 1.0
    keeper.unreachable("shard-1")
    clock.now += 5.0
    gone = keeper.unreachable("shard-1")

    # Assert: only a silence of the whole 5 s declares it gone
    assert first is None and second is None
    assert gone == RingView(1, ("shard-0", "shard-2")) == keeper.view
    assert [(m.version, m.removed) for m in keeper.moves] == [(1, "shard-1")]
    assert "unreachable for 5.0 s" in keeper.moves[0].reason


@pytest.mark.parametrize("gone_after_s", [0.0, 5.0])
def test_the_last_shard_or_a_keeper_that_never_declares_one_keeps_the_ring(
    gone_after_s: float,
) -> None:
    # Prepare
    clock = Clock()
    keeper = RingKeeper(
        ["shard-0"] if gone_after_s else SHARDS, gone_after_s=gone_after_s, clock=clock
    )

    # Execute
    keeper.unreachable("shard-0")
    clock.now += 3600.0
    gone = keeper.unreachable("shard-0")

    # Assert
    assert gone is None and keeper.view.version == 0 and not keeper.moves


def test_the_ring_and_its_moves_survive_a_checkpoint() -> None:
    # Prepare: the operator removes shard-2
    keeper = RingKeeper(SHARDS, gone_after_s=5.0)
    keeper.remove("shard-2")
    with pytest.raises(ConfigError):
        keeper.remove("shard-2")

    # Execute
    restored = RingKeeper(SHARDS, gone_after_s=5.0)
    restored.load_state_dict(keeper.state_dict())
    restored.load_state_dict(None)  # a checkpoint of before rings changes nothing

    # Assert
    assert restored.view == RingView(1, ("shard-0", "shard-1"))
    assert restored.moves == keeper.moves
    assert restored.moves[0].reason == "removed by the operator"


def test_every_change_is_saved_before_it_is_seen_and_a_restart_never_goes_back(
    tmp_path: Path,
) -> None:
    # Prepare: a keeper saving to a ring file; its checkpoint was taken before any change
    path = tmp_path / "coordinator" / RING_FILE
    keeper = RingKeeper(SHARDS, gone_after_s=5.0, known=[*SHARDS, "shard-3"], path=path)
    checkpointed = keeper.state_dict()

    # Execute: shard-2 removed, shard-3 to join (said to the operator), then a restart from the
    # older checkpoint
    keeper.remove("shard-2")
    keeper.join("shard-3")
    restored = RingKeeper(SHARDS, gone_after_s=5.0, known=[*SHARDS, "shard-3"], path=path)
    restored.load_state_dict(checkpointed)

    # Assert: the file is private; the restarted keeper goes on with the newer ring and the
    # join to come
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert restored.view == RingView(1, ("shard-0", "shard-1"))
    assert restored.moves == keeper.moves
    assert restored.status_lines()[-1] == "shard-3 joins at the next round"
    assert restored.admit_joins() == RingView(2, ("shard-0", "shard-1", "shard-3"))
    again = RingKeeper(SHARDS, gone_after_s=5.0, path=path)
    again.load_state_dict(restored.state_dict())
    assert again.view.version == 2  # the file follows every change, joins included

    # Assert: a damaged ring file stops the restart with one line
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptStateError, match="shard ring"):
        RingKeeper(SHARDS, gone_after_s=5.0, path=path).load_state_dict(checkpointed)


def test_a_shard_the_operator_adds_joins_at_the_next_round_and_survives_a_checkpoint() -> None:
    # Prepare: shard-3 is configured, off the ring (a standby); the check of emptiness passes
    checked: list[str] = []
    keeper = RingKeeper(
        SHARDS, gone_after_s=5.0, known=[*SHARDS, "shard-3"], check_empty=checked.append
    )

    # Execute: the operator adds it; the keeper checkpoints; the next round admits it
    keeper.join("shard-3")
    restored = RingKeeper(SHARDS, gone_after_s=5.0, known=[*SHARDS, "shard-3"])
    restored.load_state_dict(keeper.state_dict())
    pending = restored.joining
    lines_before = restored.status_lines()
    admitted = restored.admit_joins()

    # Assert: checked once, on the ring only once admitted, one version up, shown as a move
    assert checked == ["shard-3"]
    assert keeper.view.version == 0 and pending == ("shard-3",)
    assert lines_before == ("shard-3 joins at the next round",)
    assert admitted == RingView(1, (*SHARDS, "shard-3")) == restored.view
    assert restored.admit_joins() is None and not restored.joining
    assert [(m.version, m.added, m.removed) for m in restored.moves] == [(1, "shard-3", "")]
    assert restored.status_lines() == ("version 1: shard-3 added (joined by the operator)",)


@pytest.mark.parametrize(
    ("shard", "match"),
    [("shard-1", "on the ring already"), ("shard-9", "not a shard of"), ("", "not a shard of")],
)
def test_only_a_configured_shard_off_the_ring_can_join(shard: str, match: str) -> None:
    keeper = RingKeeper(SHARDS, gone_after_s=5.0, known=[*SHARDS, "shard-3"])
    with pytest.raises(ConfigError, match=match):
        keeper.join(shard)


def test_a_shard_declared_gone_can_join_again_once_empty_but_not_twice() -> None:
    # Prepare: shard-1 is removed; the emptiness check refuses at first (it kept its state)
    refusals = [FedPSError("shard-1 holds version 3 of the model and round 4")]

    def check_empty(shard: str) -> None:
        if refusals:
            raise refusals.pop()

    keeper = RingKeeper(SHARDS, gone_after_s=5.0, check_empty=check_empty)
    keeper.remove("shard-1")

    # Execute
    with pytest.raises(FedPSError, match="holds version 3"):
        keeper.join("shard-1")
    keeper.join("shard-1")
    with pytest.raises(ConfigError, match="already"):
        keeper.join("shard-1")
    keeper.admit_joins()

    # Assert: removed at version 1, back at version 2
    assert keeper.view == RingView(2, tuple(SHARDS))
    assert [m.line.split(" (")[0] for m in keeper.moves] == [
        "version 1: shard-1 removed",
        "version 2: shard-1 added",
    ]


def test_a_shard_is_silent_from_the_call_it_left_unanswered_not_from_its_failure() -> None:
    # Prepare: a shard cut off the network fails a call only at the call's deadline
    clock = Clock()
    keeper = RingKeeper(SHARDS, gone_after_s=5.0, clock=clock)
    asked_at = keeper.now()

    # Execute: the call made at asked_at fails 6 s later (its deadline)
    clock.now += 6.0
    gone = keeper.unreachable("shard-1", asked_at)

    # Assert: 6 s unanswered: gone at its first failure, not one deadline later
    assert gone == RingView(1, ("shard-0", "shard-2"))
    assert "unreachable for 6.0 s" in keeper.moves[0].reason


def test_shards_quarantined_on_proof_are_declared_gone_but_never_the_last() -> None:
    # Prepare: the key holder quarantined shard-1, and shard-9, which is not on the ring
    keeper = RingKeeper(SHARDS, gone_after_s=0.0)

    # Execute
    left = keeper.quarantined(["shard-9", "shard-1"])
    again = keeper.quarantined(["shard-1"])  # a later refusal names it again

    # Assert: shard-1 removed once, with the reason; nothing else moved
    assert left == [] and again == []
    assert keeper.view == RingView(1, ("shard-0", "shard-2"))
    assert [(m.removed, m.reason) for m in keeper.moves] == [
        ("shard-1", "quarantined: the key holder proved it tampered")
    ]
    lone = RingKeeper(["shard-0"], gone_after_s=0.0)
    assert lone.quarantined(["shard-0"]) == ["shard-0"]  # the run stops instead
    assert lone.view.version == 0
