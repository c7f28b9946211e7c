"""What the coordinator runs by, in one frozen record.

:func:`server.serve.coordinator_settings` makes it from the configuration;
:meth:`server.coordinator.coordinator.Coordinator.open` builds a coordinator from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedps.config import ClusterConfig, PrivacyConfig, TlsConfig, TrainingConfig

__all__ = ["MAX_HELD_CALLS", "CoordinatorSettings"]

#: ``GetTask`` calls the coordinator holds at once by default (a long poll each); its gRPC
#: server has this many threads more than the other roles'.
MAX_HELD_CALLS = 32


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordinator's schedule and limits, from the configuration.

    Parameters
    ----------
    training
        The rounds (``[training]``): how many, synchronous or asynchronous, the cohort, the
        quorum, the deadlines and the evaluation and checkpoint periods.
    privacy
        The privacy level (``[privacy]``): Poisson cohorts at client level, a model that
        DP-SGD can train at example level.
    cluster
        The addresses of the key holder and the shards (``[cluster]``).
    tls
        How clients prove their identity (``[tls]``: a certificate, or an enrolment token
        checked against the key in ``tls.directory``).
    values_per_block
        Values in one model block (the run's CKKS parameters).
    max_clients
        Most clients one round may have (``he.max_clients``).
    max_shard_misses
        Calls to one shard in a row that miss ``shard_deadline_s`` after which the run stops,
        naming it (``security.max_shard_misses``).
    shard_deadline_s
        The deadline of opening and closing a round on a shard (``security.shard_deadline_s``).
    client_eval
        Whether clients report the metrics of each round's starting model on their own data
        when the operator holds no evaluation data (``task.client_eval``).
    max_held_calls
        ``GetTask`` calls held at once while their answer would be WAIT (a long poll each,
        holding a server thread); beyond it, WAIT is answered at once.
    """

    training: TrainingConfig
    privacy: PrivacyConfig
    cluster: ClusterConfig
    tls: TlsConfig
    values_per_block: int
    max_clients: int
    max_shard_misses: int = 3
    shard_deadline_s: float = 60.0
    client_eval: bool = False
    max_held_calls: int = MAX_HELD_CALLS
