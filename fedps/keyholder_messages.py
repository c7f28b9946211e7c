"""The plain records of ``keyholder.proto``, each with its one conversion to and from the wire.

:class:`~fedps.keyholder_client.KeyHolderClient` sends and receives them; the key holder's
servicer and commit log decode into them and encode from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crypto.signed_update import SignedUpdate
from fedps.messages import (
    ParameterBlock,
    WireRecord,
    from_message,
    members_from_proto,
    members_to_proto,
    signed_update_from_proto,
    signed_update_to_proto,
    to_message,
)
from fedps.proto import keyholder_pb2

__all__ = [
    "AppliedRound",
    "CommitClosing",
    "CommitOpening",
    "CommitSet",
    "ModelState",
    "ModelUpload",
    "PublicContextInfo",
    "RoundApplication",
    "UpdateCommitment",
]


@dataclass(frozen=True)
class CommitOpening:
    """The coordinator opens a round's commit phase for a cohort (client id -> Ed25519 key)."""

    round: int
    version: int
    run_id: str
    context_id: str
    members: dict[str, bytes]

    def to_proto(self) -> keyholder_pb2.OpenCommitsRequest:
        """The wire form (members by client id)."""
        members = members_to_proto(self.members)
        return to_message(keyholder_pb2.OpenCommitsRequest, self, members=members)

    @classmethod
    def from_proto(cls, message: keyholder_pb2.OpenCommitsRequest) -> CommitOpening:
        """From the wire form."""
        return from_message(cls, message, members=members_from_proto(message.members))


@dataclass(frozen=True)
class UpdateCommitment:
    """A client's commitment to a round: its signed update and its ciphertexts' sketches
    (little-endian uint64, sketch count x blocks)."""

    round: int
    update: SignedUpdate
    sketches: bytes = b""

    def to_proto(self) -> keyholder_pb2.CommitRequest:
        """The wire form."""
        update = signed_update_to_proto(self.update)
        return to_message(keyholder_pb2.CommitRequest, self, update=update)

    @classmethod
    def from_proto(cls, message: keyholder_pb2.CommitRequest) -> UpdateCommitment:
        """From the wire form."""
        return from_message(cls, message, update=signed_update_from_proto(message.update))


@dataclass(frozen=True, slots=True)
class CommitClosing(WireRecord[keyholder_pb2.CloseCommitsRequest]):
    """Ask who committed to ``round``; with ``freeze``, accept no commitment after."""

    wire = keyholder_pb2.CloseCommitsRequest

    round: int
    freeze: bool


@dataclass(frozen=True)
class CommitSet:
    """The clients committed so far, whether the phase is frozen, and (frozen) each
    committed signed update by client id."""

    client_ids: tuple[str, ...]
    frozen: bool
    updates: tuple[SignedUpdate, ...] = ()

    def to_proto(self) -> keyholder_pb2.CommitSet:
        """The wire form."""
        updates = [signed_update_to_proto(u) for u in self.updates]
        return to_message(keyholder_pb2.CommitSet, self, updates=updates)

    @classmethod
    def from_proto(cls, message: keyholder_pb2.CommitSet) -> CommitSet:
        """From the wire form."""
        updates = tuple(signed_update_from_proto(u) for u in message.updates)
        return from_message(cls, message, updates=updates)


@dataclass(frozen=True, slots=True)
class PublicContextInfo(WireRecord[keyholder_pb2.PublicContextReply]):
    """The key holder's public context, its id, its Ed25519 key and its signature
    (:func:`crypto.signing.context_digest`)."""

    wire = keyholder_pb2.PublicContextReply

    context: bytes
    context_id: str
    signing_key: bytes
    signature: bytes


@dataclass(frozen=True)
class ModelUpload:
    """The chief's initial model (one message of it: some of its blocks)."""

    num_params: int
    blocks: tuple[ParameterBlock, ...]
    force: bool = False
    version: int = 0

    def to_proto(self) -> keyholder_pb2.InitializeRequest:
        """The wire form."""
        blocks = [b.to_proto() for b in self.blocks]
        return to_message(keyholder_pb2.InitializeRequest, self, blocks=blocks)

    @classmethod
    def from_proto(cls, message: keyholder_pb2.InitializeRequest) -> ModelUpload:
        """From the wire form."""
        blocks = tuple(ParameterBlock.from_proto(b) for b in message.blocks)
        return from_message(cls, message, blocks=blocks)


@dataclass(frozen=True)
class ModelState(WireRecord[keyholder_pb2.ModelState]):
    """The key holder's model: version, size, last applied round, and the tampering it
    detected by shard (with the shards it no longer decrypts for)."""

    wire = keyholder_pb2.ModelState

    version: int
    num_params: int
    initialized: bool
    last_round: int
    detections: dict[str, int] = field(default_factory=dict)
    quarantined: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoundApplication:
    """The coordinator asks to apply ``round`` (trained on ``version``) with exactly the
    clients it closed with."""

    round: int
    version: int
    run_id: str
    members: dict[str, bytes]

    def to_proto(self) -> keyholder_pb2.ApplyRoundRequest:
        """The wire form."""
        members = members_to_proto(self.members)
        return to_message(keyholder_pb2.ApplyRoundRequest, self, members=members)

    @classmethod
    def from_proto(cls, message: keyholder_pb2.ApplyRoundRequest) -> RoundApplication:
        """From the wire form."""
        return from_message(cls, message, members=members_from_proto(message.members))


@dataclass(frozen=True, slots=True)
class AppliedRound(WireRecord[keyholder_pb2.ApplyRoundReply]):
    """What applying a round released: the new version, the fewest contributors of any
    block, block 0's total weight, the update's norm and (client-level DP) the noise."""

    wire = keyholder_pb2.ApplyRoundReply

    version: int
    fewest_contributors: int
    total_weight: float
    update_norm: float
    noise_multiplier: float = 0.0
    top_up_std: float = 0.0
