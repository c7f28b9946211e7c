"""Tests for server.coordinator.round_phases, a round's push phase and its verdict: the shards
take pushes only when a quorum committed, the round is checkpointed while it pushes and when it
closes, and a round that fewer than ``min_quorum`` clients completed is abandoned with its sums
discarded."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import cast

import pytest

from crypto.signing import BlockSigner
from fedps.config import load_config
from fedps.round_timer import RoundTimer
from fedps.rpc.keyholder_messages import CommitOpening, CommitSet
from server.coordinator.cluster_peers import ClusterPeers
from server.coordinator.ring_keeper import RingKeeper, ShardGoneError
from server.coordinator.round_phases import RoundPhases
from server.coordinator.round_policy import create_round_policy
from server.coordinator.round_record import OpenRound, RoundRecord
from server.coordinator.task_desk import TaskDesk
from server.serve import open_coordinator

COHORT = frozenset({"client-0", "client-1", "client-2"})


class _Shards:
    """The shards, as a push phase calls them: ``complete`` are the clients that push all."""

    def __init__(self, complete: frozenset[str]) -> None:
        self.complete = complete
        self.calls: list[str] = []
        self.members: list[list[str]] = []  # of each round opened
        self.ring = RingKeeper(["shard-0", "shard-1"], gone_after_s=0.0)

    def open_round(self, opening: CommitOpening, commitments: CommitSet) -> None:
        self.calls.append("open")
        self.members.append(sorted(opening.members))

    def close_round(self, round_: int, cohort: frozenset[str]) -> set[str]:
        self.calls.append("close")
        return set(self.complete & cohort)

    def discard_round(self, round_: int) -> None:
        self.calls.append("discard")


def _phases(tmp_path: Path, shards: _Shards, checkpoints: list[tuple[bool, bool]]) -> RoundPhases:
    """Round phases with the cohort registered, ``shards`` and a quorum of 2 (the default).

    Each checkpoint adds whether its round was pushing and closing to ``checkpoints``.
    """
    config = load_config(None, cluster={"state_dir": str(tmp_path)})
    coordinator = open_coordinator(config, tmp_path / "coordinator")
    for identity in sorted(COHORT):
        coordinator.registry.register(
            identity,
            100,
            coordinator.layout.num_params,
            BlockSigner().public_key,
            identity=identity,
        )
    changed, stop = threading.Condition(), threading.Event()
    return RoundPhases(
        peers=cast(ClusterPeers, shards),
        desk=TaskDesk(
            coordinator.registry, changed, stop=stop, max_held_calls=4, client_eval=False
        ),
        registry=coordinator.registry,
        policy=create_round_policy("sync", config.training),
        timer=RoundTimer(),
        checkpoint=lambda opened: checkpoints.append((opened.pushing, opened.closing)),
        changed=changed,
        stop=stop,
        deadline_s=config.training.deadline_s,
    )


@pytest.mark.parametrize(
    ("committed", "complete", "calls", "accepted", "abandoned"),
    [
        (COHORT, COHORT, ["open", "close"], set(COHORT), False),
        (COHORT, frozenset({"client-0"}), ["open", "close", "discard"], {"client-0"}, True),
        (frozenset({"client-0"}), frozenset({"client-0"}), [], set(), True),
    ],
    ids=["a quorum completes", "too few complete", "too few committed"],
)
def test_a_push_phase_accepts_a_quorum_and_abandons_a_round_short_of_one(
    tmp_path: Path,
    committed: frozenset[str],
    complete: frozenset[str],
    calls: list[str],
    accepted: set[str],
    abandoned: bool,
) -> None:
    # Prepare: every committed client has reported its push already
    shards, checkpoints = _Shards(complete), list[tuple[bool, bool]]()
    phases = _phases(tmp_path, shards, checkpoints)
    opened = OpenRound(1, 0, math.inf, COHORT, reported=set(committed))
    record = RoundRecord(1, 0, 0, cohort=len(COHORT))
    commitments = CommitSet(tuple(sorted(committed)), frozen=True)

    # Execute
    pushed = phases.push(opened, committed, commitments, run_id="run", resume=None, record=record)

    # Assert: the shards took pushes only from the committed clients, and only with a quorum
    pushing = bool(calls)
    assert shards.calls == calls
    assert shards.members == ([sorted(committed)] if pushing else [])
    assert pushed == accepted
    assert (record.contributors, record.abandoned) == (len(accepted), abandoned)
    expected_checkpoints = [(True, False), (True, True)] if pushing else []
    assert checkpoints == expected_checkpoints


class _MovingShards(_Shards):
    """Shards of which shard-1 is declared gone at the first close; the clients push again."""

    def __init__(self, complete: frozenset[str], opened: OpenRound) -> None:
        super().__init__(complete)
        self.opened = opened

    def open_round(self, opening: CommitOpening, commitments: CommitSet) -> None:
        super().open_round(opening, commitments)
        self.opened.reported.update(opening.members)  # they push (again) and report

    def close_round(self, round_: int, cohort: frozenset[str]) -> set[str]:
        if "close" not in self.calls:
            self.calls.append("close")
            raise ShardGoneError("shard-1 is gone (close round)", self.ring.remove("shard-1"))
        return super().close_round(round_, cohort)


def test_a_shard_gone_at_the_close_starts_the_push_phase_again_on_the_new_ring(
    tmp_path: Path,
) -> None:
    # Prepare: every client reported its push; shard-1 is declared gone as the round closes
    opened = OpenRound(1, 0, math.inf, COHORT, reported=set(COHORT))
    shards, checkpoints = _MovingShards(COHORT, opened), list[tuple[bool, bool]]()
    phases = _phases(tmp_path, shards, checkpoints)
    record = RoundRecord(1, 0, 0, cohort=len(COHORT))
    commitments = CommitSet(tuple(sorted(COHORT)), frozen=True)

    # Execute
    pushed = phases.push(opened, COHORT, commitments, run_id="run", resume=None, record=record)

    # Assert: opened again on the new ring (its checkpoint not closing), closed with everyone
    assert shards.calls == ["open", "close", "open", "close"]
    assert shards.ring.view.nodes == ("shard-0",)
    assert pushed == set(COHORT) and not record.abandoned
    assert checkpoints == [(True, False), (True, True), (True, False), (True, True)]
