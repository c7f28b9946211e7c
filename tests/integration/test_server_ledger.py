"""The epsilon the cluster reports is the server's: a client cannot reset it.

A client that starts again mid-run on a fresh state folder (same identity, same data) has a
ledger that says 0. Its released rounds are what the key holder applied with it: the test
recomputes their epsilon with the accountant and compares it with what the coordinator
reports. Used to report the largest figure either process said (a client that reset its state
folder under-reported by the rounds it trained before).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from clients.edge_client import EdgeClient
from fedps.learning.accounting import epsilon
from server.keyholder.keyholder import KeyHolder
from server.keyholder.state_store import RoundResult
from tests.conftest import run_clients, start_cluster
from tests.in_process_cluster import Cluster
from tests.waiting import HANG_S

pytestmark = [pytest.mark.integration, pytest.mark.privacy]

CLIENT = "client-0"
NOISE = 1.0
ROUNDS = 8  # the run
DELTA = 1e-5  # the configuration's default
#: one client, the whole digits set, few DP-SGD steps a round (a loaded machine keeps the
#: rounds' deadlines)
_TRAINING = {"rounds": ROUNDS, "clients": 1, "min_quorum": 1, "deadline_s": 30.0, "batch_size": 128}
FIRST_LIFE = 4  # rounds the client trains on its first state folder


def _train_until(client: EdgeClient, cluster: Cluster, round_: int) -> None:
    """Run ``client``'s tasks until the coordinator finished ``round_``, then drop it."""
    assert client.session.start(time.time() + HANG_S)
    until = time.monotonic() + HANG_S
    try:
        while cluster.coordinator.round < round_:
            assert time.monotonic() < until, f"hang guard: round {round_} never finished"
            task = client.session.poll_task(retry_s=HANG_S, wait_s=0.5)
            assert client.run_task(task)
    finally:
        client.session.shutdown()
        client.close()


def _releases(keyholder: KeyHolder) -> dict[int, RoundResult]:
    """What each round the key holder applies from now on released, by round (filled as
    the rounds are applied)."""
    released: dict[int, RoundResult] = {}
    apply_round = keyholder.apply_round

    def recording(round_: int, *args: Any, **kwargs: Any) -> RoundResult:
        result = apply_round(round_, *args, **kwargs)
        released.setdefault(round_, result)
        return result

    keyholder.apply_round = recording  # type: ignore[method-assign]
    return released


def _with_client(released: dict[int, RoundResult]) -> list[RoundResult]:
    """The released rounds that ``CLIENT`` contributed to."""
    return [r for r in released.values() if CLIENT in r.contributors]


def test_a_client_on_a_fresh_state_folder_cannot_lower_the_reported_epsilon(
    tmp_path: Path,
) -> None:
    # Prepare: one client, a run of ROUNDS rounds at a fixed noise multiplier (no budget)
    cluster = start_cluster(
        tmp_path,
        training=_TRAINING,
        privacy={"noise_multiplier": NOISE},
    )
    released = _releases(cluster.keyholder)
    try:
        first = EdgeClient.open(cluster.config, index=0, state_dir=tmp_path / "first")
        steps_per_round = first.trainer.steps_per_round  # type: ignore[attr-defined]
        sample_rate = first.trainer.sample_rate
        _train_until(first, cluster, FIRST_LIFE)

        # Execute: the same identity and data start again on a fresh state folder
        fresh = EdgeClient.open(cluster.config, index=0, state_dir=tmp_path / "fresh")
        (summary,) = run_clients([fresh])
        reported = cluster.coordinator.client_epsilons[CLIENT]
        largest = cluster.coordinator.max_epsilon[0]
        history = list(cluster.coordinator.history)
        assert cluster.config.privacy.delta == DELTA
        rounds = len(_with_client(released))
        recomputed = epsilon(NOISE, sample_rate, steps_per_round * rounds, DELTA)
        warnings = cluster.coordinator.registry.warnings
    finally:
        cluster.stop()

    # Assert: rounds were applied with the client on both folders (one open while it came
    # back is abandoned: it was opened for its old signing key), and the cluster reports what
    # the released rounds spent, not what the fresh folder says
    assert len([r for r in history if not r.abandoned]) > FIRST_LIFE
    assert summary.epsilon < 0.95 * recomputed  # type: ignore[attr-defined]  # the fresh ledger
    print(f"reported {reported:.4f}, recomputed from the released rounds {recomputed:.4f}")
    assert reported == pytest.approx(recomputed, rel=0.01)
    assert largest == pytest.approx(recomputed, rel=0.01)
    assert history[-1].max_epsilon == pytest.approx(recomputed, rel=0.01)
    # The operator is told: a new signing key, and a spend below the server's figure
    assert any(w.startswith(f"{CLIENT} registered with a new signing key") for w in warnings)
    assert any(w.startswith(f"{CLIENT} registered with epsilon 0.0000") for w in warnings)
    print("\n".join(warnings))


def test_a_client_on_a_fresh_state_folder_is_stopped_at_its_target_by_the_server(
    tmp_path: Path,
) -> None:
    # Prepare: the run would go on for ROUNDS rounds; the client's noise is calibrated for
    # BUDGET rounds at the target, so the server's spend reaches it after BUDGET released rounds
    budget, target = 3, 2.0
    cluster = start_cluster(
        tmp_path,
        training=_TRAINING,
        privacy={"target_epsilon": target},
    )
    training = cluster.config.training.model_copy(update={"rounds": budget})
    own = cluster.config.model_copy(update={"training": training})
    applied = _releases(cluster.keyholder)
    try:
        first = EdgeClient.open(own, index=0, state_dir=tmp_path / "first")
        steps_per_round = first.trainer.steps_per_round  # type: ignore[attr-defined]
        sigma, sample_rate = first.trainer.noise_multiplier, first.trainer.sample_rate
        _train_until(first, cluster, budget - 1)

        # Execute: it comes back on a fresh state folder, which says it spent nothing
        fresh = EdgeClient.open(own, index=0, state_dir=tmp_path / "fresh")
        (summary,) = run_clients([fresh])  # the server tells it the run is done for it
        released = _with_client(applied)
        reported = cluster.coordinator.client_epsilons[CLIENT]
        spent = cluster.coordinator.registry.spent_clients()
        live = cluster.coordinator.registry.live()
    finally:
        cluster.stop()

    # Assert: not drawn once one more round would pass the target, whatever its folder says
    recomputed = epsilon(sigma, sample_rate, steps_per_round * len(released), DELTA)
    assert len(released) == budget
    assert recomputed <= target
    assert reported == pytest.approx(recomputed, rel=0.01)
    assert summary.epsilon < reported  # type: ignore[attr-defined]  # its own ledger: less
    assert spent == [CLIENT] and live == []
