"""Prometheus metrics of the server roles (prometheus-client), one class per role.

Each is on its own HTTP port with its own registry, so a role exports only its own metrics and
several roles can share a process (as in the tests).

- :class:`ShardMetrics`: push messages by outcome and refusal reason
  (``fedps_pushes_total{outcome="refused",reason="stale_update"}``), blocks added or
  acknowledged as duplicates, bytes received, push latency.
- :class:`KeyHolderMetrics`: tampered aggregates refused (by shard and reason), rounds
  refused by the decryption policy and commitments refused (by reason), apply latency.
- :class:`CoordinatorMetrics`: rounds by outcome, round durations, the open round's or
  buffer's fill, where the rounds' time went (the seconds of each phase, on the critical path,
  of the servers and of the clients: ``fedps_round_phase_seconds{scope="critical",
  phase="train"}``, and the last round's critical path), and what the operator asks about a
  run: the last evaluated accuracy, loss and task metrics, the largest epsilon with its delta,
  and each client's epsilon (the server's figure: :mod:`server.coordinator.privacy_ledger`).
  They are read from the coordinator when Prometheus scrapes, so nothing is pushed.

Every role shows its model version; the key holder and the coordinator the age of their last
checkpoint and the calls to each shard that missed their deadline
(``fedps_shard_misses_total{shard="shard-1",call="FetchAggregate"}``: the key holder's
fetches, the coordinator's ``OpenRound`` and ``CloseRound``). Labels never carry keys or
update values, and only one carries a client id:
``fedps_client_epsilon{client="client-0"}`` on the coordinator. A client id is the
pseudonymous name the operator enrolled the client under (``client-N`` or its certificate's
name), which the operator already knows, and the endpoint listens on loopback, for the
operator on that host, unless ``metrics.public`` is set (and the role then warns).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fedps.errors import error_reason

__all__ = ["CoordinatorMetrics", "KeyHolderMetrics", "PartyMetrics", "ShardMetrics"]

#: Upper bounds (seconds) of the round-duration histogram's buckets.
ROUND_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Upper bounds (seconds) of the round-phase histogram's buckets.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _RoleMetrics:
    """What every role's metrics have: a registry, the model version, an HTTP endpoint."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.version = Gauge("fedps_model_version", "Current model version", registry=self.registry)
        self.port = 0

    def track_checkpoint(self, last_checkpoint: Callable[[], float]) -> None:
        """Report the age of the checkpoint whose unix time ``last_checkpoint`` returns."""
        age = Gauge(
            "fedps_last_checkpoint_age_seconds",
            "Seconds since the last checkpoint",
            registry=self.registry,
        )
        age.set_function(
            lambda: time.time() - last_checkpoint() if last_checkpoint() else float("nan")
        )

    def track_shard_misses(self) -> Callable[[str, str], None]:
        """Count the calls to shards that missed their deadline, by shard and call.

        Returns what counts one (a :class:`server.shard_misses.ShardMisses`'s ``on_miss``).
        """
        misses = Counter(
            "fedps_shard_misses",
            "Calls to a shard that missed their deadline, by shard and call",
            ["shard", "call"],
            registry=self.registry,
        )
        return lambda shard, call: misses.labels(shard, call).inc()

    def serve(self, address: str) -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: any free port); returns the port."""
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self.port = int(server.server_port)
        return self.port


class ShardMetrics(_RoleMetrics):
    """A shard's metrics: pushes, blocks, bytes received and push latency.

    Parameters
    ----------
    role
        The shard's id, such as ``shard-0``.
    """

    def __init__(self, role: str) -> None:
        super().__init__(role)
        r = self.registry
        self.latency = Histogram(
            "fedps_seconds", "Time of the shard's pushes", ["operation"], registry=r
        )
        self.pushes = Counter(
            "fedps_pushes",
            "Push messages by outcome (accepted, refused) and refusal reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.blocks = Counter(
            "fedps_blocks",
            "Encrypted blocks by outcome (added, duplicate)",
            ["outcome"],
            registry=r,
        )
        self.bytes_received = Counter(
            "fedps_received_bytes", "Bytes of encrypted blocks received", registry=r
        )

    def push_refused(self, exc: Exception) -> None:
        """Count one refused push message, by the error's kind."""
        self.pushes.labels("refused", error_reason(exc)).inc()

    def push_accepted(self, added: int, duplicates: int, nbytes: int, seconds: float) -> None:
        """Count one accepted push message that took ``seconds``."""
        self.pushes.labels("accepted", "").inc()
        self.blocks.labels("added").inc(added)
        self.blocks.labels("duplicate").inc(duplicates)
        self.bytes_received.inc(nbytes)
        self.latency.labels("push").observe(seconds)


class KeyHolderMetrics(_RoleMetrics):
    """The key holder's metrics.

    Refusals (tampered aggregates, rounds, commitments) and apply latency.
    """

    def __init__(self) -> None:
        super().__init__("keyholder")
        r = self.registry
        self.latency = Histogram(
            "fedps_seconds", "Time of the key holder's applications", ["operation"], registry=r
        )
        self.tampering = Counter(
            "fedps_tampering_detected",
            "Aggregates the key holder refused as tampered, by shard and reason",
            ["shard", "reason"],
            registry=r,
        )
        self.blamed = Counter(
            "fedps_clients_blamed",
            "Clients the key holder blamed on evidence after a failed check (then excluded)",
            registry=r,
        )
        self.refused_rounds = Counter(
            "fedps_refused_rounds",
            "Rounds the decryption policy refused (never decrypted), by reason",
            ["reason"],
            registry=r,
        )
        self.commitments = Counter(
            "fedps_commitments",
            "Client commitments by outcome (accepted, refused) and refusal reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.parties_down = Gauge(
            "fedps_keyholder_parties_down",
            "Key-holder parties that did not answer the combiner's last decryption (0 with one "
            "key holder)",
            registry=r,
        )

    def client_blamed(self, client: str) -> None:
        """Count one client blamed on evidence.

        No label: client ids stay out of metrics here; the key holder's state and `fedps status`
        name it.
        """
        del client
        self.blamed.inc()

    def tampering_detected(self, shard: str, reason: str) -> None:
        """Count one tampered aggregate the key holder refused."""
        self.tampering.labels(shard, reason).inc()

    def round_refused(self, exc: Exception) -> None:
        """Count one round the decryption policy refused, by the error's kind."""
        self.refused_rounds.labels(error_reason(exc)).inc()

    def commitment_refused(self, exc: Exception) -> None:
        """Count one refused commitment, by the error's kind."""
        self.commitments.labels("refused", error_reason(exc)).inc()

    def commitment_accepted(self) -> None:
        """Count one accepted commitment."""
        self.commitments.labels("accepted", "").inc()


class PartyMetrics(_RoleMetrics):
    """A key-holder party's metrics: its answers to the combiner, its refusals, its share.

    Parameters
    ----------
    role
        The party's name, such as ``party-2``.
    """

    def __init__(self, role: str) -> None:
        super().__init__(role)
        r = self.registry
        self.latency = Histogram(
            "fedps_seconds",
            "Time of the party's answers (canaries, partial, prepare)",
            ["operation"],
            registry=r,
        )
        self.answers = Counter(
            "fedps_party_answers",
            "The combiner's requests by kind (canaries, partial, prepare) and outcome (answered, "
            "refused) with the refusal's reason",
            ["kind", "outcome", "reason"],
            registry=r,
        )
        self.ready = Gauge(
            "fedps_party_ready",
            "1 once the party holds its share of the joint key (its key generation finished)",
            registry=r,
        )

    def answered(self, kind: str, seconds: float) -> None:
        """Count one request of ``kind`` answered in ``seconds``."""
        self.answers.labels(kind, "answered", "").inc()
        self.latency.labels(kind).observe(seconds)

    def refused(self, kind: str, exc: Exception) -> None:
        """Count one request of ``kind`` refused, by the error's kind."""
        self.answers.labels(kind, "refused", error_reason(exc)).inc()


class _Round(Protocol):
    """What the coordinator's metrics read of a round's record."""

    @property
    def seconds(self) -> float: ...
    @property
    def abandoned(self) -> bool: ...
    @property
    def round(self) -> int: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def phases(self) -> Mapping[str, float]: ...
    @property
    def server_phases(self) -> Mapping[str, float]: ...
    @property
    def client_phases(self) -> Mapping[str, Mapping[str, float]]: ...


class _Run(Protocol):
    """What the coordinator's metrics read of the coordinator."""

    @property
    def history(self) -> Sequence[_Round]: ...
    @property
    def max_epsilon(self) -> tuple[float, float]: ...
    @property
    def client_epsilons(self) -> dict[str, float]: ...


class CoordinatorMetrics(_RoleMetrics):
    """The coordinator's metrics.

    Rounds by outcome and duration, the open round's fill, and the run's accuracy, loss, task
    metrics and privacy spend (:meth:`watch`).
    """

    def __init__(self) -> None:
        super().__init__("coordinator")
        self.buffer_fill = Gauge(
            "fedps_buffer_fill",
            "Updates reported in the open round or buffer",
            registry=self.registry,
        )

    def watch(self, run: _Run) -> None:
        """Read the rounds and the privacy spend of ``run`` (the coordinator) at each scrape."""
        self.registry.register(_RunCollector(run))


class _RunCollector(Collector):
    """The metrics of a coordinator's history and privacy spend, read at each scrape."""

    def __init__(self, run: _Run) -> None:
        self._run = run

    def collect(self) -> Iterator[Metric]:
        history = list(self._run.history)  # a copy: rounds are appended meanwhile
        rounds = GaugeMetricFamily(
            "fedps_rounds",
            "Rounds or buffers so far, by outcome (applied, abandoned)",
            labels=["outcome"],
        )
        abandoned = sum(1 for r in history if r.abandoned)
        rounds.add_metric(["applied"], len(history) - abandoned)
        rounds.add_metric(["abandoned"], abandoned)
        yield rounds
        yield _histogram(
            "fedps_round_seconds",
            "Duration of the closed rounds (applied or abandoned)",
            [r.seconds for r in history],
        )
        yield from _phases(history)
        yield from _evaluation(history)
        epsilon, delta = self._run.max_epsilon
        yield GaugeMetricFamily(
            "fedps_epsilon_max",
            "The largest client epsilon (the server's privacy ledger, or a client's own if larger)",
            value=epsilon,
        )
        yield GaugeMetricFamily("fedps_delta", "The delta of the largest epsilon", value=delta)
        clients = GaugeMetricFamily(
            "fedps_client_epsilon",
            "Each client's epsilon (the server's privacy ledger, or its own if larger), by its "
            "pseudonymous client id",
            labels=["client"],
        )
        for client, value in sorted(self._run.client_epsilons.items()):
            clients.add_metric([client], value)
        yield clients


def _evaluation(history: Sequence[_Round]) -> Iterator[Metric]:
    """The metrics of the last evaluated round.

    ``fedps_accuracy`` (if the task has one), ``fedps_loss`` and ``fedps_task_metric{name}`` for
    each other metric of the task.
    """
    evaluated = next((r for r in reversed(history) if r.metrics), None)
    if evaluated is None:
        return
    yield GaugeMetricFamily(
        "fedps_evaluated_round",
        "The round whose model was last evaluated",
        value=evaluated.round,
    )
    for name in ("accuracy", "loss"):
        if name in evaluated.metrics:
            yield GaugeMetricFamily(
                f"fedps_{name}",
                f"The {name} of the last evaluated model",
                value=evaluated.metrics[name],
            )
    task = GaugeMetricFamily(
        "fedps_task_metric",
        "The task's other metrics of the last evaluated model, by name",
        labels=["name"],
    )
    for name, value in sorted(evaluated.metrics.items()):
        if name not in ("accuracy", "loss"):
            task.add_metric([name], value)
    yield task


def _phases(history: Sequence[_Round]) -> Iterator[Metric]:
    """Where the rounds' time went, read from the history.

    ``fedps_round_phase_seconds{scope, phase}`` is a histogram of each phase's seconds over
    the rounds (``scope``: ``critical`` for the critical path, ``server`` for the
    coordinator's and the key holder's own phases, ``client`` for every client's phases the
    history keeps, without the client's id); ``fedps_last_round_phase_seconds{phase}`` is
    the last round's critical path.
    """
    seen: dict[tuple[str, str], list[float]] = {}
    for record in history:
        scopes = [("critical", record.phases), ("server", record.server_phases)]
        scopes += [("client", phases) for phases in record.client_phases.values()]
        for scope, phases in scopes:
            for phase, seconds in phases.items():
                seen.setdefault((scope, phase), []).append(seconds)
    family = HistogramMetricFamily(
        "fedps_round_phase_seconds",
        "Seconds of each phase of the rounds: on the critical path, of the servers, of clients",
        labels=["scope", "phase"],
    )
    for (scope, phase), values in sorted(seen.items()):
        buckets, total = _buckets(values, PHASE_BUCKETS)
        family.add_metric([scope, phase], buckets, total)
    yield family
    last = GaugeMetricFamily(
        "fedps_last_round_phase_seconds",
        "The last round's critical path: seconds of each of its phases",
        labels=["phase"],
    )
    for phase, seconds in (history[-1].phases if history else {}).items():
        last.add_metric([phase], seconds)
    yield last


def _buckets(
    values: Sequence[float], bounds: Sequence[float]
) -> tuple[list[tuple[str, float]], float]:
    """The cumulative buckets of ``values`` under ``bounds``, and their sum.

    Cumulative as Prometheus counts them, ``+Inf`` last.
    """
    buckets = [(str(bound), float(sum(1 for v in values if v <= bound))) for bound in bounds]
    buckets.append(("+Inf", float(len(values))))
    return buckets, math.fsum(values)


def _histogram(name: str, documentation: str, values: Sequence[float]) -> Metric:
    """A histogram of ``values`` with the :data:`ROUND_BUCKETS`."""
    buckets, total = _buckets(values, ROUND_BUCKETS)
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)
