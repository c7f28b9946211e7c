"""The plain records of ``coordinator.proto``, each with its one conversion to and from the wire.

:class:`~fedps.coordinator_client.CoordinatorClient` sends and receives them; the
coordinator's servicer decodes requests into them and encodes its replies from them, and
:class:`server.coordinator.coordinator.Coordinator` hands out :class:`Task` records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from fedps.messages import WireRecord, from_message, to_message
from fedps.proto import coordinator_pb2

__all__ = [
    "CREDENTIAL_HEADER",
    "RETRY_AFTER_S",
    "ClientRegistration",
    "ClusterStatus",
    "RegistrationReply",
    "RoundSummary",
    "Task",
    "TaskQuery",
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


@dataclass(frozen=True, slots=True)
class ClientRegistration(WireRecord[coordinator_pb2.RegisterRequest]):
    """A client registers: its name, data size, model size, Ed25519 key, enrolment token
    (without TLS) and the privacy it has spent so far (epsilon at delta)."""

    wire = coordinator_pb2.RegisterRequest

    name: str
    num_examples: int
    num_params: int
    signing_key: bytes
    enrolment_token: str = ""
    epsilon: float = 0.0
    delta: float = 0.0


@dataclass(frozen=True)
class RegistrationReply:
    """The coordinator's answer to a registration: the caller's client id, the run, where
    the key holder and the shards are (``{shard_id: address}``), and the credential to send
    on every later call."""

    client_id: str
    run_id: str
    keyholder: str
    shards: dict[str, str]
    virtual_nodes: int
    num_params: int
    rounds: int
    credential: bytes = b""

    def to_proto(self) -> coordinator_pb2.RegisterReply:
        """The wire form (shards in order)."""
        shards = [
            coordinator_pb2.ShardAddress(shard_id=s, address=a) for s, a in self.shards.items()
        ]
        return to_message(coordinator_pb2.RegisterReply, self, shards=shards)

    @classmethod
    def from_proto(cls, message: coordinator_pb2.RegisterReply) -> RegistrationReply:
        """From the wire form."""
        shards = {s.shard_id: s.address for s in message.shards}
        return from_message(cls, message, shards=shards)


@dataclass(frozen=True, slots=True)
class TaskQuery(WireRecord[coordinator_pb2.TaskRequest]):
    """A client asks for its next task, carrying the privacy spend it recorded."""

    wire = coordinator_pb2.TaskRequest

    client_id: str
    epsilon: float = 0.0
    delta: float = 0.0


@dataclass(frozen=True)
class Task:
    """What a client should do next: ``kind`` is ``"wait"``, ``"train"``, ``"push"`` or
    ``"done"``."""

    kind: str
    round: int = 0
    version: int = 0
    deadline_unix: float = 0.0  # math.inf: no deadline (an asynchronous buffer's commits)
    retry_after: float = RETRY_AFTER_S
    weight_scale: float = 1.0
    context_id: str = ""

    def to_proto(self) -> coordinator_pb2.Task:
        """The wire form."""
        return to_message(coordinator_pb2.Task, self, kind=_KINDS[self.kind])

    @classmethod
    def from_proto(cls, message: coordinator_pb2.Task) -> Task:
        """From the wire form."""
        return from_message(cls, message, kind=_KIND_NAMES[message.kind])


@dataclass(frozen=True, slots=True)
class UpdateReport(WireRecord[coordinator_pb2.UpdateReport]):
    """A client reports a round: its weight, privacy spend, bytes pushed, whether its budget
    is spent, and the noise multiplier of its DP training (0: no noise)."""

    wire = coordinator_pb2.UpdateReport

    client_id: str
    round: int
    weight: float = 0.0
    epsilon: float = 0.0
    delta: float = 0.0
    bytes_pushed: int = 0
    budget_exhausted: bool = False
    noise_multiplier: float = 0.0


@dataclass(frozen=True, slots=True)
class RoundSummary(WireRecord[coordinator_pb2.RoundSummary]):
    """One finished round, as the operator sees it (accuracy negative: not evaluated)."""

    wire = coordinator_pb2.RoundSummary

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

    @classmethod
    def of(cls, record: Any) -> RoundSummary:
        """The summary of ``record``: its attributes of the same names."""
        return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ClusterStatus:
    """What the coordinator reports to the operator."""

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

    def to_proto(self) -> coordinator_pb2.ClusterStatus:
        """The wire form."""
        history = [r.to_proto() for r in self.history]
        return to_message(coordinator_pb2.ClusterStatus, self, history=history)

    @classmethod
    def from_proto(cls, message: coordinator_pb2.ClusterStatus) -> ClusterStatus:
        """From the wire form."""
        history = tuple(RoundSummary.from_proto(r) for r in message.history)
        return from_message(cls, message, history=history)
