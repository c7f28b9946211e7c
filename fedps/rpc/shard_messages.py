"""The plain records of ``shard.proto``, each with its one conversion to and from the wire.

:class:`~fedps.rpc.shard_stub.ShardStub` sends and receives them; the shard's servicer and log
decode into them and encode from them; :class:`server.shard.shard.Shard` never sees protobuf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from crypto.canary import CanaryOpening
from crypto.signed_update import SignedUpdate
from fedps.proto import shard_pb2
from fedps.rpc.messages import (
    COMMITMENTS,
    MEMBERS,
    SIGNED_UPDATES,
    Aggregate,
    Converter,
    MalformedReplyError,
    ParameterBlock,
    WireRecord,
    framed,
    from_message,
    records_of,
    to_message,
    varint_field,
)

__all__ = [
    "AggregatePart",
    "ClosedRound",
    "HeldCiphertext",
    "OpenedBlock",
    "Publication",
    "PushBatch",
    "PushReceipt",
    "RoundOpening",
    "ShardStatus",
    "TraceEvidence",
    "TraceQuery",
]


@dataclass(frozen=True)
class RoundOpening(WireRecord[shard_pb2.OpenRoundRequest]):
    """The coordinator opens ``round`` on model ``version`` for a cohort.

    The cohort maps client id -> Ed25519 key, with each member's commitment fixed at the key holder.
    """

    wire = shard_pb2.OpenRoundRequest
    nested: ClassVar[Mapping[str, Converter]] = {"members": MEMBERS, "commitments": COMMITMENTS}

    round: int
    version: int
    members: dict[str, bytes]
    context_id: str
    run_id: str = ""
    commitments: dict[str, SignedUpdate] = field(default_factory=dict)
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


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

    @classmethod
    def carrying(
        cls,
        update: SignedUpdate,
        *,
        round_: int,
        context_id: str,
        blocks: list[tuple[int, bytes]],
        signed: bool = True,
    ) -> PushBatch:
        """A push of ``blocks`` (block, packed ciphertext) that carries ``update``.

        ``signed=False`` leaves out its commitment (nonce, signature, block roots: 34 bytes a
        block): a later message of one stream, which takes the stream's first one's
        (:meth:`inheriting`).
        """
        commitment = (update.nonce, update.signature, update.roots) if signed else (b"", b"", ())
        return cls(
            update.client_id, round_, update.version, update.weight, context_id, blocks, *commitment
        )

    def inheriting(self, first: PushBatch | None) -> PushBatch:
        """The message, with the commitment of its stream's ``first`` if it carries none.

        Only from a first message of the same client, round, version, weight and context: the
        commitment is then checked on this message as on that one (a message that inherits none
        stays unsigned, and is refused as such).
        """
        if self.signature or first is None:
            return self
        same = (self.client_id, self.round, self.version, self.weight, self.context_id)
        if same != (first.client_id, first.round, first.version, first.weight, first.context_id):
            return self
        return replace(self, nonce=first.nonce, signature=first.signature, roots=first.roots)

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
        """The wire bytes: what is sent, what a shard logs, what a prepared push is kept as.

        The message :meth:`to_proto` gives, as long as protobuf's own encoding of it (its
        fields in another order): the fields but the blocks encoded by protobuf, then each
        block's field framed around its ciphertext, which is copied once, into the result.
        """
        parts = [replace(self, blocks=[]).to_proto().SerializeToString()]
        for block, ciphertext in self.blocks:  # EncryptedBlock: block (1), ciphertext (2)
            number = varint_field(1, block) if block else b""  # proto3 leaves zeros out
            data = framed(2, ciphertext) if ciphertext else []
            parts += framed(6, number, *data)  # PushRequest.blocks (6)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> PushBatch:
        """A push kept with :meth:`serialize`."""
        return cls.from_proto(shard_pb2.PushRequest.FromString(data))


@dataclass(frozen=True, slots=True)
class PushReceipt:
    """A shard's acknowledgement of a push.

    ``sent_bytes``: what the caller sent (not on the wire).
    """

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
class AggregatePart(WireRecord[shard_pb2.FetchAggregateReply]):
    """One message of a closed round's aggregates.

    Encrypted sums with their manifests, and the contributors' signed updates (each once over the
    stream).
    """

    wire = shard_pb2.FetchAggregateReply
    nested: ClassVar[Mapping[str, Converter]] = {
        "blocks": records_of(Aggregate),
        "updates": SIGNED_UPDATES,
    }

    blocks: tuple[Aggregate, ...] = ()
    updates: tuple[SignedUpdate, ...] = ()


@dataclass(frozen=True)
class TraceQuery(WireRecord[shard_pb2.TraceRequest]):
    """The key holder asks for evidence on ``blocks`` of a closed round, after a failed check.

    The evidence is each contributor's canary openings (no ``challenge_seed``), or, with the round's
    challenge seed and each contributor's committed ``sketches`` of those blocks (in the order of
    ``contributors``; (count x blocks) little-endian uint64), the ciphertexts whose sketch is not
    the committed one.
    """

    wire = shard_pb2.TraceRequest

    round: int
    blocks: tuple[int, ...]
    contributors: tuple[str, ...]
    challenge_seed: bytes = b""
    sketches: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class OpenedBlock(WireRecord[shard_pb2.CanaryOpening]):
    """One contributor's canary opening of one block, as bytes.

    See :class:`crypto.canary.CanaryOpening`.
    """

    wire = shard_pb2.CanaryOpening

    client_id: str
    block: int
    c1: bytes
    c0_canaries: bytes
    rest_digest: bytes

    @classmethod
    def of(cls, client_id: str, block: int, opening: CanaryOpening) -> OpenedBlock:
        """``client_id``'s ``opening`` of ``block``, its arrays as little-endian bytes."""
        return cls(
            client_id,
            block,
            opening.c1.astype("<u8").tobytes(),
            opening.c0_canaries.astype("<u8").tobytes(),
            opening.rest_digest,
        )

    def opening(self) -> CanaryOpening:
        """The opening itself.

        Raises
        ------
        MalformedReplyError
            Coefficients that are not whole uint64 values.
        """
        if len(self.c1) % 8 or len(self.c0_canaries) % 8:
            raise MalformedReplyError("an opening's coefficients are 8 bytes each")
        return CanaryOpening(
            np.frombuffer(self.c1, dtype="<u8").astype(np.uint64),
            np.frombuffer(self.c0_canaries, dtype="<u8").astype(np.uint64),
            self.rest_digest,
        )


@dataclass(frozen=True)
class HeldCiphertext(WireRecord[shard_pb2.HeldCiphertext]):
    """One contributor's whole packed ciphertext of one block."""

    wire = shard_pb2.HeldCiphertext

    client_id: str
    block: int
    ciphertext: bytes


@dataclass(frozen=True)
class TraceEvidence(WireRecord[shard_pb2.TraceReply]):
    """One message of a shard's answer to a :class:`TraceQuery`."""

    wire = shard_pb2.TraceReply
    nested: ClassVar[Mapping[str, Converter]] = {
        "openings": records_of(OpenedBlock),
        "mismatches": records_of(HeldCiphertext),
    }

    openings: tuple[OpenedBlock, ...] = ()
    mismatches: tuple[HeldCiphertext, ...] = ()


@dataclass(frozen=True)
class Publication(WireRecord[shard_pb2.PublishRequest]):
    """A published version of some blocks of the model.

    One publish message, or a shard's saved model.
    """

    wire = shard_pb2.PublishRequest
    nested: ClassVar[Mapping[str, Converter]] = {"blocks": records_of(ParameterBlock)}

    version: int
    num_blocks: int
    values_per_block: int
    blocks: tuple[ParameterBlock, ...] = ()
    #: the shard ring it goes with (:class:`~fedps.sharding.ring_view.RingView`; 0 and none: none)
    ring_version: int = 0
    ring_nodes: tuple[str, ...] = ()


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
    #: refused push messages by reason (the error's kind in snake_case)
    refusals: dict[str, int] = field(default_factory=dict)
