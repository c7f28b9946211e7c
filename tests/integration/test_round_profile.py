"""Where a real round's time goes: every phase of it is reported, by every client and by the
servers, and its critical path fits in the round (real gRPC servers on loopback, real CKKS,
real Opacus; no clock budget: only what was measured is compared with itself)."""

from __future__ import annotations

import json
import math

import pytest

from clients.edge_client import EdgeClient
from fedps.round_timer import CLIENT_PHASES, COORDINATOR_PHASES, CRITICAL_PATH, KEYHOLDER_PHASES
from fedps.runtime.cluster_status import print_status, status_json
from tests.conftest import Cluster, run_clients

pytestmark = pytest.mark.integration

#: What a client times in every round it trains in (client_eval: only with task.client_eval).
_TIMED = set(CLIENT_PHASES) - {"client_eval"}
#: What the key holder times of every round (rotate: only when the keys rotate).
_APPLIED = set(KEYHOLDER_PHASES) - {"rotate"}


def test_every_phase_of_a_round_is_reported_and_the_critical_path_fits_in_it(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    config = cluster.config
    clients = [EdgeClient.open(config, index=i) for i in range(config.training.clients)]
    # Execute
    run_clients(clients)
    status = print_status(config)  # what `fedps status` prints, and --json writes
    printed = capsys.readouterr().out
    # Assert
    history = cluster.coordinator.history
    assert len(history) == config.training.rounds
    for record in history:
        assert not record.abandoned
        assert set(record.client_phases) == {c.client_id for c in clients}
        for phases in record.client_phases.values():
            assert set(phases) == _TIMED
        assert set(record.server_phases) == set(COORDINATOR_PHASES) | _APPLIED
        assert set(record.phases) == (_TIMED | {"open", "close", "evaluate", "other"} | _APPLIED)
        assert list(record.phases) == [p for p in CRITICAL_PATH if p in record.phases]
        every = [
            *record.phases.values(),
            *record.server_phases.values(),
            *(s for phases in record.client_phases.values() for s in phases.values()),
        ]
        assert all(math.isfinite(s) and s >= 0 for s in every)
        measured = sum(s for p, s in record.phases.items() if p != "other")
        assert measured <= record.seconds * (1 + 1e-3)  # its parts do not overlap (two clocks)
        assert math.isclose(sum(record.phases.values()), record.seconds)
        assert record.phases["train"] > 0 and record.phases["noise"] > 0
        assert record.server_phases["apply_call"] >= sum(record.server_phases[p] for p in _APPLIED)
    # What the operator sees is what the coordinator recorded.
    assert [dict(r.phases) for r in status.history] == [r.phases for r in history]
    assert [dict(r.client_phases) for r in status.history] == [r.client_phases for r in history]
    assert f"critical path of round {config.training.rounds}, " in printed
    written = json.loads(status_json(status))
    assert written["history"][-1]["phases"] == history[-1].phases
    assert written["history"][-1]["server_phases"] == history[-1].server_phases
