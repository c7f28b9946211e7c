"""On loopback, the real coordinator: client-level cohorts are Poisson samples at the rate the
clients' accountant uses, also when fewer clients are live than provisioned."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from fedps.errors import RoundClosedError
from fedps.learning.accounting import client_level_noise
from tests.conftest import Cluster, start_cluster
from tests.round_driver import TaskPoller

pytestmark = [pytest.mark.integration, pytest.mark.privacy, pytest.mark.slow]

PROVISIONED = 20
COHORT = 6  # q = 6 / 20
LIVE = 10
ROUNDS = 40


def _poll_until_done(cluster: Cluster, live: int, stop: threading.Event) -> list[TaskPoller]:
    """Run ``client-0`` ... ``client-{live - 1}`` as task pollers until the run is done.

    They poll every 0.1 s (a real client's pace is 0.2 s): well inside a round's commit
    deadline, without ten threads keeping the coordinator busy at 50 calls a second each."""
    size = cluster.coordinator.layout.num_params
    pollers = [
        TaskPoller(cluster.config, f"client-{i}", num_params=size, poll_s=0.1) for i in range(live)
    ]
    threads = [threading.Thread(target=p.run, args=(stop,)) for p in pollers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    stop.set()
    return pollers


def test_participation_rate_is_the_accountants_rate_with_half_the_clients_live(
    tmp_path: Path,
) -> None:
    # Prepare: 20 clients provisioned, 10 of them live; no training (the pollers answer every
    # TRAIN with an empty report), so the rounds end without updates.
    cluster = start_cluster(
        tmp_path,
        training={
            "rounds": ROUNDS,
            "clients": PROVISIONED,
            "cohort_size": COHORT,
            "min_quorum": 1,  # only an empty cohort is skipped: every draw counts
            "deadline_s": 1.0,
        },
        privacy={"level": "client", "noise_multiplier": 1.0},
    )
    stop = threading.Event()
    try:
        coordinator = cluster.coordinator
        rate = client_level_noise(cluster.config.training, cluster.config.privacy).sample_rate

        # Execute
        pollers = _poll_until_done(cluster, LIVE, stop)

        # Assert: every global round ran or was skipped, and each drawn client was asked ...
        assert coordinator.finished
        history = coordinator.history
        assert [r.round for r in history] == list(range(1, ROUNDS + 1))
        assert sum(r.cohort for r in history) == sum(len(p.asked) for p in pollers)
        # ... at the accountant's rate q = 0.3 per global round (a fixed 6 of the 10 live
        # gave 0.6), within 5 standard deviations.
        participation = sum(len(p.asked) for p in pollers) / (LIVE * ROUNDS)
        assert rate == pytest.approx(COHORT / PROVISIONED)
        assert abs(participation - rate) < 5 * math.sqrt(rate * (1 - rate) / (LIVE * ROUNDS))
    finally:
        stop.set()
        cluster.stop()


def test_a_cohort_below_the_quorum_skips_its_round_and_opens_nothing(tmp_path: Path) -> None:
    # Prepare: 3 of 20 provisioned clients live, q = 0.3, a quorum of all three: almost every
    # draw (97%) is too small.
    rounds, quorum = 5, 3
    cluster = start_cluster(
        tmp_path,
        training={
            "rounds": rounds,
            "clients": PROVISIONED,
            "cohort_size": COHORT,
            "min_quorum": quorum,
            "deadline_s": 0.5,
        },
        privacy={"level": "client", "noise_multiplier": 1.0},
    )
    stop = threading.Event()
    try:
        coordinator = cluster.coordinator

        # Execute
        pollers = _poll_until_done(cluster, quorum, stop)

        # Assert: every global round counted, skipped ones abandoned with nobody asked to
        # train and no commit phase opened at the key holder.
        history = coordinator.history
        assert coordinator.finished
        assert [r.round for r in history] == list(range(1, rounds + 1))
        skipped = {r.round for r in history if r.cohort < quorum}
        assert skipped  # all but impossible otherwise: 0.027^5
        for record in history:
            if record.round in skipped:
                assert record.abandoned and record.contributors == 0
                with pytest.raises(RoundClosedError, match="not open"):
                    cluster.keyholder.commits.phase(record.round)
        assert all(not (p.asked & skipped) for p in pollers)
    finally:
        stop.set()
        cluster.stop()
