"""The plain records of ``coordinator.proto``, each with its one conversion to and from the wire.

:class:`~fedps.rpc.coordinator_stub.CoordinatorStub` sends and receives them; the
coordinator's servicer decodes requests into them and encodes its replies from them, and
:class:`server.coordinator.coordinator.Coordinator` hands out :class:`Assignment` records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from fedps.proto import coordinator_pb2
from fedps.rpc.messages import Converter, WireRecord, records_of

__all__ = [
    "CREDENTIAL_HEADER",
    "RETRY_AFTER_S",
    "Assignment",
    "AssignmentQuery",
    "ClientRegistration",
    "ClosedRound",
    "ClusterStatus",
    "RegistrationReply",
    "RoundSummary",
    "UpdateReport",
]

#: Metadata key carrying a client's credential (hex) on every call after registration.
CREDENTIAL_HEADER = "x-fedps-credential"
#: How long a client told to wait waits before it asks again (seconds).
RETRY_AFTER_S = 0.2

_KINDS = {
    "wait": coordinator_pb2.Task.WAIT,
    "train": coordinator_pb2.Task.TRAIN,
    "done": coordinator_pb2.Task.DONE,
    "push": coordinator_pb2.Task.PUSH,
}
_KIND_NAMES = {number: name for name, number in _KINDS.items()}
#: A task's kind: its name here, the enum on the wire (a kind this client does not know: wait).
_KIND: Converter = (_KINDS.__getitem__, lambda number: _KIND_NAMES.get(number, "wait"))
#: Shards (shard id -> address), in order on the wire.
_SHARDS: Converter = (
    lambda shards: [coordinator_pb2.ShardAddress(shard_id=s, address=a) for s, a in shards.items()],
    lambda messages: {m.shard_id: m.address for m in messages},
)
#: Each client's phases of a round (client id -> seconds by phase), by client id on the wire.
_CLIENT_PHASES: Converter = (
    lambda phases: [
        coordinator_pb2.ClientPhases(client_id=c, phase_seconds=p)
        for c, p in sorted(phases.items())
    ],
    lambda messages: {m.client_id: dict(m.phase_seconds) for m in messages},
)


@dataclass(frozen=True, slots=True)
class ClosedRound(WireRecord[coordinator_pb2.ClosedRound]):
    """The clients a round closed with, and the shard ring it is applied on (a party's check)."""

    wire = coordinator_pb2.ClosedRound

    round: int
    contributors: tuple[str, ...]
    #: the shard ring now (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: the shards)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClientRegistration(WireRecord[coordinator_pb2.RegisterRequest]):
    """A client's registration.

    Its name, data size, model size, Ed25519 key, enrolment token (without TLS), the privacy it
    has spent so far (epsilon at delta) and what it declares of its training.
    """

    wire = coordinator_pb2.RegisterRequest

    name: str
    num_examples: int
    num_params: int
    signing_key: bytes
    enrolment_token: str = ""
    epsilon: float = 0.0
    delta: float = 0.0
    #: what the client declares of its training (the coordinator's privacy ledger records it
    #: for each round released with it): its data's fingerprint, one round's DP-SGD
    data_source: str = ""
    noise_multiplier: float = 0.0
    sample_rate: float = 0.0
    steps_per_round: int = 0


@dataclass(frozen=True)
class RegistrationReply(WireRecord[coordinator_pb2.RegisterReply]):
    """The coordinator's answer to a registration.

    The caller's client id, the run, where the key holder and the shards are
    (``{shard_id: address}``), and the credential to send on every later call.
    """

    wire = coordinator_pb2.RegisterReply
    nested: ClassVar[Mapping[str, Converter]] = {"shards": _SHARDS}

    client_id: str
    run_id: str
    keyholder: str
    shards: dict[str, str]
    virtual_nodes: int
    num_params: int
    rounds: int
    credential: bytes = b""
    #: the shard ring now (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: the shards)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AssignmentQuery(WireRecord[coordinator_pb2.TaskRequest]):
    """A client asks for its next task, carrying the privacy spend it recorded.

    A waiting client lets the coordinator hold the call up to ``wait_s`` until its task changes;
    one that committed to a round says which (``committed_round``), and waits for its push phase.
    """

    wire = coordinator_pb2.TaskRequest

    client_id: str
    epsilon: float = 0.0
    delta: float = 0.0
    #: how long the coordinator may hold the call while the answer would be WAIT (a long
    #: poll; 0: answer at once)
    wait_s: float = 0.0
    #: the round the client committed to and now waits to push (0: none): the coordinator
    #: holds its call until the push phase opens instead of answering TRAIN again
    committed_round: int = 0


@dataclass(frozen=True)
class Assignment(WireRecord[coordinator_pb2.Task]):
    """What a client should do next.

    ``kind`` is ``"wait"``, ``"train"``, ``"push"`` or ``"done"``.
    """

    wire = coordinator_pb2.Task
    nested: ClassVar[Mapping[str, Converter]] = {"kind": _KIND}

    kind: str
    round: int = 0
    version: int = 0
    deadline_unix: float = 0.0  # math.inf: no deadline (an asynchronous buffer's commits)
    retry_after: float = RETRY_AFTER_S
    weight_scale: float = 1.0
    context_id: str = ""
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class UpdateReport(WireRecord[coordinator_pb2.UpdateReport]):
    """A client's report of a round.

    Its weight, privacy spend, bytes pushed, whether its budget is spent, the noise multiplier of
    its DP training (0: no noise), with ``task.client_eval`` the task's metrics of the model it
    trained from on its own data, and the seconds it spent in each phase of the round
    (:data:`fedps.round_timer.CLIENT_PHASES`).
    """

    wire = coordinator_pb2.UpdateReport

    client_id: str
    round: int
    weight: float = 0.0
    epsilon: float = 0.0
    delta: float = 0.0
    bytes_pushed: int = 0
    budget_exhausted: bool = False
    noise_multiplier: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundSummary(WireRecord[coordinator_pb2.RoundSummary]):
    """One finished round, as the operator sees it (accuracy negative: not evaluated).

    ``metrics`` is the task's evaluation of the round's model: ``loss`` and the task's
    metrics (``accuracy`` for a classification task by default); with ``task.client_eval``
    (no evaluation data at the operator) the clients' median on their own data of the model
    the round started from, the previous round's; empty when the round was not
    evaluated.

    Where its seconds went (:mod:`fedps.round_timer`): ``phases`` is its critical path,
    ``server_phases`` the coordinator's and the key holder's own phases, ``client_phases``
    each client's (client id -> seconds by phase; the slowest 16 to commit, for the
    last 64 rounds).
    """

    wire = coordinator_pb2.RoundSummary
    nested: ClassVar[Mapping[str, Converter]] = {"client_phases": _CLIENT_PHASES}

    round: int
    version: int
    contributors: int
    accuracy: float
    loss: float
    max_epsilon: float
    bytes_pushed: int
    seconds: float
    abandoned: bool
    push_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    server_phases: dict[str, float] = field(default_factory=dict)
    client_phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, record: Any) -> RoundSummary:
        """The summary of ``record``: its attributes of the same names."""
        return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})

    def line(self, rounds: int) -> str:
        """One readable line for the round, of ``rounds``.

        Such as ``round 3/10: 5 clients, accuracy 0.912, epsilon 1.84 (max), 4.2 s``: the accuracy,
        if the task reports one, then the task's other metrics (its loss only when there is no
        accuracy), such as ``loss 0.27, mae 0.41``. Every role and the CLI say a round this way.
        """
        head = f"round {self.round}/{rounds}: "
        if self.abandoned:
            return f"{head}abandoned (no quorum, {self.contributors} pushed), {self.seconds:.1f} s"
        n = self.contributors
        parts = [f"{n} client{'' if n == 1 else 's'}"]
        if self.accuracy >= 0:
            parts.append(f"accuracy {self.accuracy:.3f}")
        shown = {"accuracy", "loss"} if self.accuracy >= 0 else {"accuracy"}
        parts += [f"{k} {v:.4g}" for k, v in sorted(self.metrics.items()) if k not in shown]
        parts += [f"epsilon {self.max_epsilon:.2f} (max)", f"{self.seconds:.1f} s"]
        return head + ", ".join(parts)


@dataclass(frozen=True)
class ClusterStatus(WireRecord[coordinator_pb2.ClusterStatus]):
    """What the coordinator reports to the operator."""

    wire = coordinator_pb2.ClusterStatus
    nested: ClassVar[Mapping[str, Converter]] = {"history": records_of(RoundSummary)}

    run_id: str
    round: int
    version: int
    registered: int
    finished: bool
    history: tuple[RoundSummary, ...]
    max_epsilon: float
    delta: float
    bytes_pushed: int
    last_checkpoint_unix: float
    client_epsilons: dict[str, float] = field(default_factory=dict)
    noise: str = ""
    client_noise_multipliers: dict[str, float] = field(default_factory=dict)
    #: rounds each registered client reported an update for (its participation)
    client_rounds: dict[str, int] = field(default_factory=dict)
    #: the coordinator's calls to each shard that missed their deadline (open, close)
    shard_misses: dict[str, int] = field(default_factory=dict)
    #: the shards that missed ``security.max_shard_misses`` in a row, not answered since
    stalled: tuple[str, ...] = ()
    #: how many registered clients were told the run is done (a ``DONE`` task)
    told_done: int = 0
    #: the largest epsilon each client reported itself (``client_epsilons`` is the server's)
    client_reported_epsilons: dict[str, float] = field(default_factory=dict)
    #: privacy warnings for the operator (a client below the server's figure, a new key)
    privacy_warnings: tuple[str, ...] = ()
    #: clients the server's ledger stopped (one more round would pass the target)
    spent_clients: tuple[str, ...] = ()
    #: clients a privacy warning names
    flagged_clients: tuple[str, ...] = ()
    #: the shard ring now, and each of its moves (a line each), oldest first
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()
    ring_moves: tuple[str, ...] = ()
