"""The plain records of ``shard.proto``, each with its one conversion to and from the wire.

:class:`~fedps.shard_client.ShardClient` sends and receives them; the shard's servicer and log
decode into them and encode from them; :class:`server.shard.shard.Shard` never sees protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crypto.signed_update import SignedUpdate
from fedps.messages import (
    Aggregate,
    ParameterBlock,
    WireRecord,
    from_message,
    members_from_proto,
    members_to_proto,
    signed_update_from_proto,
    signed_update_to_proto,
    to_message,
)
from fedps.proto import shard_pb2

__all__ = [
    "AggregatePart",
    "ClosedRound",
    "Publication",
    "PushBatch",
    "PushReceipt",
    "RoundOpening",
    "ShardStatus",
]


@dataclass(frozen=True)
class RoundOpening:
    """The coordinator opens ``round`` on model ``version`` for a cohort (client id ->
    Ed25519 key), with each member's commitment fixed at the key holder."""

    round: int
    version: int
    members: dict[str, bytes]
    context_id: str
    run_id: str = ""
    commitments: dict[str, SignedUpdate] = field(default_factory=dict)

    def to_proto(self) -> shard_pb2.OpenRoundRequest:
        """The wire form (members and commitments by client id)."""
        return to_message(
            shard_pb2.OpenRoundRequest,
            self,
            members=members_to_proto(self.members),
            commitments=[signed_update_to_proto(u) for _, u in sorted(self.commitments.items())],
        )

    @classmethod
    def from_proto(cls, message: shard_pb2.OpenRoundRequest) -> RoundOpening:
        """From the wire form."""
        return from_message(
            cls,
            message,
            members=members_from_proto(message.members),
            commitments={c.client_id: signed_update_from_proto(c) for c in message.commitments},
        )


@dataclass(frozen=True)
class PushBatch:
    """One push message: some encrypted blocks of one client's update, and its signature."""

    client_id: str
    round: int
    version: int
    weight: float
    context_id: str
    blocks: list[tuple[int, bytes]]
    nonce: bytes = b""
    signature: bytes = b""
    roots: tuple[bytes, ...] = ()

    @property
    def update(self) -> SignedUpdate:
        """The signed update the push carries."""
        return SignedUpdate(
            self.client_id, self.weight, self.nonce, self.signature, self.roots, self.version
        )

    def to_proto(self) -> shard_pb2.PushRequest:
        """The wire form."""
        blocks = [shard_pb2.EncryptedBlock(block=b, ciphertext=c) for b, c in self.blocks]
        return to_message(shard_pb2.PushRequest, self, blocks=blocks)

    @classmethod
    def from_proto(cls, message: shard_pb2.PushRequest) -> PushBatch:
        """From the wire form."""
        blocks = [(b.block, bytes(b.ciphertext)) for b in message.blocks]
        return from_message(cls, message, blocks=blocks)

    def serialize(self) -> bytes:
        """The wire bytes (to keep a prepared push outside the process)."""
        return bytes(self.to_proto().SerializeToString())

    @classmethod
    def from_bytes(cls, data: bytes) -> PushBatch:
        """A push kept with :meth:`serialize`."""
        return cls.from_proto(shard_pb2.PushRequest.FromString(data))


@dataclass(frozen=True, slots=True)
class PushReceipt:
    """A shard's acknowledgement of a push; ``sent_bytes``: what the caller sent (not on
    the wire)."""

    accepted: int
    duplicates: int
    sent_bytes: int = 0

    def to_proto(self) -> shard_pb2.PushReply:
        """The wire form."""
        return to_message(shard_pb2.PushReply, self)

    @classmethod
    def from_proto(cls, message: shard_pb2.PushReply, sent_bytes: int = 0) -> PushReceipt:
        """From the wire form."""
        return from_message(cls, message, sent_bytes=sent_bytes)


@dataclass(frozen=True, slots=True)
class ClosedRound(WireRecord[shard_pb2.CloseRoundReply]):
    """A closed round on one shard: the clients that pushed every block it owns."""

    wire = shard_pb2.CloseRoundReply

    complete_clients: tuple[str, ...]
    blocks: int


@dataclass(frozen=True)
class AggregatePart:
    """One message of a closed round's aggregates: encrypted sums with their manifests, and
    the contributors' signed updates (each once over the stream)."""

    blocks: tuple[Aggregate, ...] = ()
    updates: tuple[SignedUpdate, ...] = ()

    def to_proto(self) -> shard_pb2.FetchAggregateReply:
        """The wire form."""
        return shard_pb2.FetchAggregateReply(
            blocks=[a.to_proto() for a in self.blocks],
            updates=[signed_update_to_proto(u) for u in self.updates],
        )

    @classmethod
    def from_proto(cls, message: shard_pb2.FetchAggregateReply) -> AggregatePart:
        """From the wire form (:class:`~fedps.messages.MalformedReplyError` for a manifest
        that lists a client twice)."""
        return cls(
            tuple(Aggregate.from_proto(a) for a in message.blocks),
            tuple(signed_update_from_proto(u) for u in message.updates),
        )


@dataclass(frozen=True)
class Publication:
    """A published version of some blocks of the model (one publish message, or a shard's
    saved model)."""

    version: int
    num_blocks: int
    values_per_block: int
    blocks: tuple[ParameterBlock, ...] = ()

    def to_proto(self) -> shard_pb2.PublishRequest:
        """The wire form."""
        blocks = [b.to_proto() for b in self.blocks]
        return to_message(shard_pb2.PublishRequest, self, blocks=blocks)

    @classmethod
    def from_proto(cls, message: shard_pb2.PublishRequest) -> Publication:
        """From the wire form."""
        blocks = tuple(ParameterBlock.from_proto(b) for b in message.blocks)
        return from_message(cls, message, blocks=blocks)


@dataclass(frozen=True, slots=True)
class ShardStatus(WireRecord[shard_pb2.ShardStatus]):
    """What a shard reports to the operator."""

    wire = shard_pb2.ShardStatus

    shard_id: str
    version: int
    blocks: int
    open_round: int
    round_open: bool
    pushes_accepted: int
    pushes_refused: int
    bytes_received: int
