"""End to end on loopback: client-level DP (DP-FedAvg) through real servers and real CKKS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.edge_client import ClientSummary, EdgeClient, PreparedPush
from fedps.config import FedPSConfig
from fedps.learning.accounting import epsilon, epsilon_of_history
from server.keyholder.keyholder import RoundResult
from tests.conftest import run_clients, start_cluster, start_coordinator
from tests.round_driver import HandClient, RoundDriver
from tests.simulated_dropouts import SimulatedDropouts

pytestmark = pytest.mark.integration

ROUNDS = 5
CLIENTS = 3
# A generous budget: three clients are far too few for a useful client-level epsilon, but
# enough to check the mechanics end to end while the model still learns.
TARGET_EPSILON = 50.0


class RecordingClient(EdgeClient):
    """A real client that also keeps the weight and (noised) update it encrypted."""

    def __init__(self, config: FedPSConfig, **parts: Any) -> None:
        super().__init__(config, **parts)
        self.sent: dict[int, tuple[float, np.ndarray]] = {}

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        self.sent[round_] = (self.weight, delta.copy())
        return super().prepare(round_, version, delta)


def test_client_level_training_learns_within_budget(tmp_path: Path) -> None:
    # Prepare
    cluster = start_cluster(
        tmp_path,
        training={"rounds": ROUNDS, "clients": CLIENTS, "min_quorum": CLIENTS, "deadline_s": 30.0},
        privacy={"level": "client", "target_epsilon": TARGET_EPSILON, "clip_norm": 0.5},
    )
    try:
        clients = [RecordingClient.open(cluster.config, index=i) for i in range(CLIENTS)]
        initial = cluster.coordinator.evaluator.initial_vector()

        # Execute
        summaries = run_clients(clients)

        # Assert: every round applied, the model learned (chance is 0.1 on digits) ...
        coordinator = cluster.coordinator
        assert coordinator.finished
        assert [r.round for r in coordinator.history] == list(range(1, ROUNDS + 1))
        assert not any(r.abandoned for r in coordinator.history)
        assert coordinator.history[-1].accuracy > 0.25
        # ... every weight was 1.0 and the applied model is the plain mean of the updates ...
        expected = initial.copy()
        for round_ in range(1, ROUNDS + 1):
            sent = [c.sent[round_] for c in clients]
            assert [w for w, _ in sent] == [1.0] * CLIENTS
            expected = expected + sum(d for _, d in sent) / CLIENTS
        applied = cluster.keyholder.params
        assert applied is not None
        assert np.linalg.norm(applied - expected) / np.linalg.norm(expected) < 1e-4
        # ... and the epsilon reported is the accountant's for (sigma, q = 1, ROUNDS rounds).
        sigma = clients[0].trainer.noise_multiplier
        max_epsilon, delta = coordinator.max_epsilon
        assert max_epsilon <= TARGET_EPSILON
        assert max_epsilon == pytest.approx(epsilon(sigma, 1.0, ROUNDS, delta))
        for summary in summaries:
            assert isinstance(summary, ClientSummary)
            assert summary.rounds_trained == ROUNDS
            assert summary.epsilon <= TARGET_EPSILON
    finally:
        cluster.stop()


# ---------------------------------------------------------------------- the key holder's top-up
TOP_UP_PARAMS = 20_000
SIGMA, CLIP, COHORT = 2.0, 0.2, 10
SIGNAL = 0.02  # every hand client's update is SIGNAL everywhere, plus its noise share


@pytest.mark.privacy
@pytest.mark.parametrize("contributors", [3, COHORT])
def test_keyholder_tops_up_the_noise_and_divides_by_the_cohort(
    tmp_path: Path, contributors: int
) -> None:
    # Prepare: a cohort of n = 10 whose clients add N(0, (sigma C)^2 / n) each; only
    # ``contributors`` of them contribute to the round.
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"clients": COHORT, "min_quorum": 2},
        privacy={"level": "client", "noise_multiplier": SIGMA, "clip_norm": CLIP},
    )
    try:
        keyholder = cluster.keyholder
        keyholder.initialize(np.zeros(TOP_UP_PARAMS))
        driver = RoundDriver(cluster.config, keyholder.keys.public, run_id="top-up")
        rng = np.random.default_rng(11)
        share = SIGMA * CLIP / np.sqrt(COHORT)
        clients = [
            HandClient(f"client-{i}", SIGNAL + rng.normal(0.0, share, TOP_UP_PARAMS))
            for i in range(contributors)
        ]

        # Execute
        driver.committed_round(1, 0, clients)
        reply = driver.apply(1, 0, clients)

        # Assert: the released sum (n x the model's change) is the clients' sum plus the
        # missing n - m shares: noise sigma C per value, whatever m ...
        assert keyholder.params is not None
        released = COHORT * keyholder.params
        noise_sd = SIGMA * CLIP
        sd_error = noise_sd / np.sqrt(2 * TOP_UP_PARAMS)  # of the sample std
        assert abs(np.std(released) - noise_sd) < 5 * sd_error
        assert reply.noise_multiplier == pytest.approx(SIGMA)
        assert reply.top_up_std == pytest.approx(share * np.sqrt(COHORT - contributors))
        # ... divided by the fixed n, not by the m that contributed.
        expected_mean = contributors * SIGNAL
        assert abs(np.mean(released) - expected_mean) < 5 * noise_sd / np.sqrt(TOP_UP_PARAMS)
    finally:
        cluster.stop()


# ---------------------------------------------------------------------- dropouts, end to end
DROPOUT_CLIENTS = 10
DROPOUT_ROUNDS = 12
DROPOUT_SIGMA = 4.0
DROPOUT_CLIP = 0.1


@pytest.mark.privacy
@pytest.mark.slow
def test_epsilon_with_dropouts_is_the_epsilon_of_the_released_models(tmp_path: Path) -> None:
    # Prepare: 10 clients, a cohort of everyone (q = 1), each client dies mid-round with
    # probability 0.3 (after training, before committing). mnist5k's MLP has 50,890 values:
    # the noise per value dominates the clipped signal (a sum of m <= 10 updates of L2 norm
    # <= C has at most (10 C)^2 / 50,890 of squared signal per value, 0.012% of (sigma C)^2),
    # and 12 rounds x 50,890 values estimate the noise to about 0.1%. The deadline is a hang
    # guard: a round with a death closes as at its deadline once the others have committed
    # (SimulatedDropouts), however long a loaded machine takes.
    cluster = start_cluster(
        tmp_path,
        coordinator=False,  # started once the clients are built (loading mnist5k takes a while)
        training={
            "dataset": "mnist5k",
            "rounds": DROPOUT_ROUNDS,
            "clients": DROPOUT_CLIENTS,
            "min_quorum": 2,
            "deadline_s": 60.0,
            "dropout": 0.3,
            "eval_every": DROPOUT_ROUNDS,
        },
        privacy={
            "level": "client",
            "noise_multiplier": DROPOUT_SIGMA,
            "clip_norm": DROPOUT_CLIP,
        },
        # One key for the 12 rounds: a rotation after round 10 makes every client set its
        # encryption up again, which this test does not need (rotation: test_key_rotation.py).
        security={"rotate_every_rounds": 0},
    )
    try:
        keyholder = cluster.keyholder
        released: dict[int, np.ndarray] = {}  # each round's change of the model, as released
        apply_round = keyholder.apply_round

        def recording(round_: int, *args: Any, **kwargs: Any) -> RoundResult:
            before = keyholder.params.copy() if keyholder.params is not None else None
            result = apply_round(round_, *args, **kwargs)
            assert before is not None and keyholder.params is not None
            released.setdefault(round_, keyholder.params - before)
            return result

        keyholder.apply_round = recording  # type: ignore[method-assign]
        dropouts = SimulatedDropouts(cluster)
        clients = [
            EdgeClient.open(cluster.config, index=i, mods=dropouts.mods(i))
            for i in range(DROPOUT_CLIENTS)
        ]
        coordinator = start_coordinator(cluster)

        # Execute
        run_clients(clients)

        # Assert: every round was released, many with fewer than the cohort ...
        history = coordinator.history
        assert coordinator.finished and not any(r.abandoned for r in history)
        assert sorted(released) == list(range(1, DROPOUT_ROUNDS + 1))
        assert sum(r.contributors < DROPOUT_CLIENTS for r in history) >= DROPOUT_ROUNDS // 2
        assert all(r.noise_multiplier == pytest.approx(DROPOUT_SIGMA) for r in history)
        # ... the noise measured in each released sum (n x the model's change) ...
        present = [
            float(np.sqrt(np.mean((DROPOUT_CLIENTS * released[r]) ** 2))) / DROPOUT_CLIP
            for r in sorted(released)
        ]
        delta = cluster.config.privacy.delta
        measured = epsilon_of_history([(s, 1.0, 1) for s in present], delta)
        # ... gives the epsilon the coordinator reports, within 1%.
        reported, reported_delta = coordinator.max_epsilon
        assert reported_delta == delta
        assert reported == pytest.approx(epsilon(DROPOUT_SIGMA, 1.0, DROPOUT_ROUNDS, delta))
        assert measured == pytest.approx(reported, rel=0.01)
        # Without the top-up the sums would carry sigma sqrt(m / n): the check would fail.
        short = [
            (DROPOUT_SIGMA * np.sqrt(r.contributors / DROPOUT_CLIENTS), 1.0, 1) for r in history
        ]
        assert epsilon_of_history(short, delta) > 1.05 * reported
    finally:
        cluster.stop()


@pytest.mark.privacy
def test_every_client_counts_every_global_round_drawn_for_or_not(tmp_path: Path) -> None:
    # Prepare: Poisson cohorts at q = 2 / 4, so in most runs some client is not drawn for the
    # last rounds (and a draw below the quorum skips a round): its spend must count them too
    rounds = 4
    cluster = start_cluster(
        tmp_path,
        training={
            "rounds": rounds,
            "clients": 4,
            "cohort_size": 2,
            "min_quorum": 2,
            "deadline_s": 5.0,
        },
        privacy={"level": "client", "noise_multiplier": 2.0, "clip_norm": 0.5},
    )
    try:
        clients = [EdgeClient.open(cluster.config, index=i) for i in range(4)]

        # Execute
        run_clients(clients)

        # Assert: every client's recorded and reported spend is the accountant's for every
        # global round of the run, at the Poisson rate, whichever rounds it trained in
        coordinator = cluster.coordinator
        assert coordinator.finished and coordinator.round == rounds
        expected = epsilon(2.0, 0.5, rounds, cluster.config.privacy.delta)
        for client in clients:
            assert client.trainer.history()[-1] == (2.0, 0.5, rounds)
            assert client.recorded.epsilon == pytest.approx(expected)
            assert coordinator.client_epsilons[client.client_id] == pytest.approx(expected)
    finally:
        cluster.stop()
