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
