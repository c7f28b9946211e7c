"""Each role's Prometheus metrics (server/metrics.py): only its own, and the coordinator's read
from the run when scraped."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fedps.errors import PolicyError, ShardStalledError, StaleUpdateError
from server.keyholder.aggregate_verifier import TamperingError
from server.metrics import CoordinatorMetrics, KeyHolderMetrics, PartyMetrics, ShardMetrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def names(text: str) -> set[str]:
    """The sample names of a Prometheus text page."""
    return {name for name, _ in samples(text)}


@dataclass
class _Round:
    round: int
    seconds: float
    abandoned: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    server_phases: dict[str, float] = field(default_factory=dict)
    client_phases: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class _Run:
    history: list[_Round]
    max_epsilon: tuple[float, float] = (0.0, 0.0)
    client_epsilons: dict[str, float] = field(default_factory=dict)


def test_a_shard_counts_pushes_and_exports_nothing_of_other_roles() -> None:
    # Prepare
    metrics = ShardMetrics("shard-0")
    # Execute
    metrics.push_accepted(3, 1, 1000, 0.2)
    metrics.push_refused(StaleUpdateError("old"))
    page = generate_latest(metrics.registry).decode()
    # Assert
    got = samples(page)
    assert got[("fedps_pushes_total", (("outcome", "accepted"), ("reason", "")))] == 1
    assert got[("fedps_pushes_total", (("outcome", "refused"), ("reason", "stale_update")))] == 1
    assert got[("fedps_blocks_total", (("outcome", "added"),))] == 3
    assert got[("fedps_received_bytes_total", ())] == 1000
    assert got[("fedps_seconds_count", (("operation", "push"),))] == 1
    assert not {"fedps_accuracy", "fedps_tampering_detected_total", "fedps_buffer_fill"} & set(
        names(page)
    )


def test_the_key_holder_counts_refusals_and_exports_no_shard_counters() -> None:
    metrics = KeyHolderMetrics()

    metrics.tampering_detected("shard-1", "sum")
    metrics.round_refused(TamperingError("shard-1", "sum", "x"))
    metrics.round_refused(PolicyError("quorum"))
    metrics.commitment_refused(ValueError("bad"))
    metrics.commitment_accepted()
    metrics.track_checkpoint(lambda: 0.0)
    missed = metrics.track_shard_misses()
    missed("shard-1", "FetchAggregate")
    missed("shard-1", "FetchAggregate")
    metrics.round_refused(ShardStalledError("shard-1 missed its deadline 2 times in a row"))
    page = generate_latest(metrics.registry).decode()

    got = samples(page)
    assert got[("fedps_tampering_detected_total", (("reason", "sum"), ("shard", "shard-1")))] == 1
    assert got[("fedps_refused_rounds_total", (("reason", "tampering"),))] == 1
    assert got[("fedps_refused_rounds_total", (("reason", "policy"),))] == 1
    assert got[("fedps_refused_rounds_total", (("reason", "shard_stalled"),))] == 1
    fetches = (("call", "FetchAggregate"), ("shard", "shard-1"))
    assert got[("fedps_shard_misses_total", fetches)] == 2
    refused = ("fedps_commitments_total", (("outcome", "refused"), ("reason", "invalid_argument")))
    assert got[refused] == 1
    assert got[("fedps_commitments_total", (("outcome", "accepted"), ("reason", "")))] == 1
    assert "fedps_last_checkpoint_age_seconds" in names(page)
    assert not {n for n in names(page) if n.startswith(("fedps_pushes", "fedps_blocks"))}
    assert not {"fedps_buffer_fill", "fedps_rounds", "fedps_received_bytes_total"} & names(page)


def test_the_coordinator_reads_the_run_when_scraped() -> None:
    # Prepare: two rounds, the first evaluated, the second abandoned
    run = _Run(
        history=[
            _Round(1, 3.0, metrics={"accuracy": 0.8, "loss": 0.5, "f1": 0.7}),
            _Round(2, 40.0, abandoned=True),
        ],
        max_epsilon=(1.5, 1e-5),
        client_epsilons={"client-0": 1.5, "client-1": 1.2},
    )
    metrics = CoordinatorMetrics()
    metrics.watch(run)
    # Execute
    first = samples(generate_latest(metrics.registry).decode())
    run.history.append(_Round(3, 5.0, metrics={"accuracy": 0.9, "loss": 0.3}))
    second = samples(generate_latest(metrics.registry).decode())
    # Assert
    assert first[("fedps_accuracy", ())] == 0.8
    assert first[("fedps_loss", ())] == 0.5
    assert first[("fedps_task_metric", (("name", "f1"),))] == 0.7
    assert first[("fedps_evaluated_round", ())] == 1
    assert first[("fedps_rounds", (("outcome", "abandoned"),))] == 1
    assert first[("fedps_round_seconds_count", ())] == 2
    assert first[("fedps_round_seconds_bucket", (("le", "5.0"),))] == 1
    assert first[("fedps_round_seconds_sum", ())] == 43.0
    assert first[("fedps_epsilon_max", ())] == 1.5
    assert first[("fedps_delta", ())] == 1e-5
    assert first[("fedps_client_epsilon", (("client", "client-1"),))] == 1.2
    assert second[("fedps_accuracy", ())] == 0.9
    assert second[("fedps_evaluated_round", ())] == 3
    assert second[("fedps_rounds", (("outcome", "applied"),))] == 2
    assert second[("fedps_round_seconds_count", ())] == 3


def test_a_regression_task_has_no_accuracy_and_no_round_none() -> None:
    metrics = CoordinatorMetrics()
    run = _Run(history=[])
    metrics.watch(run)

    empty = names(generate_latest(metrics.registry).decode())
    run.history.append(_Round(1, 1.0, metrics={"loss": 0.2, "mae": 0.4}))
    regression = samples(generate_latest(metrics.registry).decode())

    assert not {"fedps_accuracy", "fedps_loss", "fedps_evaluated_round"} & empty
    assert ("fedps_round_seconds_count", ()) in regression
    assert ("fedps_accuracy", ()) not in regression
    assert regression[("fedps_task_metric", (("name", "mae"),))] == 0.4


def test_metrics_are_served_over_http() -> None:
    metrics = ShardMetrics("shard-0")
    metrics.version.set(4)

    port = metrics.serve("127.0.0.1:0")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        page = reply.read().decode()

    assert port > 0
    assert samples(page)[("fedps_model_version", ())] == 4


@pytest.mark.parametrize("role", [ShardMetrics("shard-0"), KeyHolderMetrics()])
def test_roles_without_a_run_have_no_privacy_metrics(role: ShardMetrics | KeyHolderMetrics) -> None:
    page = generate_latest(role.registry).decode()

    assert not {n for n in names(page) if "epsilon" in n}


def test_the_coordinator_exports_where_the_rounds_time_went() -> None:
    # Prepare: two rounds with their phases, critical path, servers' and clients'
    run = _Run(
        history=[
            _Round(
                1,
                1.0,
                phases={"train": 0.5, "other": 0.5},
                server_phases={"commit_wait": 0.75},
                client_phases={"client-0": {"train": 0.5}, "client-1": {"train": 0.25}},
            ),
            _Round(2, 2.0, phases={"train": 1.5, "other": 0.5}),
        ]
    )
    metrics = CoordinatorMetrics()
    metrics.watch(run)
    # Execute
    got = samples(generate_latest(metrics.registry).decode())
    # Assert
    critical = (("phase", "train"), ("scope", "critical"))
    assert got[("fedps_round_phase_seconds_count", critical)] == 2
    assert got[("fedps_round_phase_seconds_sum", critical)] == 2.0
    assert got[("fedps_round_phase_seconds_bucket", (("le", "1.0"), *critical))] == 1
    client = (("phase", "train"), ("scope", "client"))
    assert got[("fedps_round_phase_seconds_count", client)] == 2  # no client id in a label
    assert got[("fedps_round_phase_seconds_sum", (("phase", "commit_wait"), ("scope", "server")))]
    assert got[("fedps_last_round_phase_seconds", (("phase", "train"),))] == 1.5
    assert not any("client-0" in str(labels) for _, labels in got)


def test_a_party_counts_its_answers_and_refusals_and_says_whether_it_holds_its_share() -> None:
    # Prepare
    metrics = PartyMetrics("party-2")
    metrics.ready.set_function(lambda: 1.0)
    # Execute
    metrics.answered("canaries", 0.1)
    metrics.answered("partial", 0.3)
    metrics.refused("partial", PolicyError("not the set the coordinator closed"))
    page = generate_latest(metrics.registry).decode()
    # Assert
    got = samples(page)
    answered = (("kind", "partial"), ("outcome", "answered"), ("reason", ""))
    refused = (("kind", "partial"), ("outcome", "refused"), ("reason", "policy"))
    assert got[("fedps_party_answers_total", answered)] == 1
    assert got[("fedps_party_answers_total", refused)] == 1
    assert got[("fedps_seconds_count", (("operation", "canaries"),))] == 1
    assert got[("fedps_party_ready", ())] == 1.0
    assert not {"fedps_tampering_detected_total", "fedps_pushes_total"} & names(page)
