"""The plain records of ``common.proto`` and their one conversion to and from the wire.

Role classes take and return these frozen dataclasses; only the typed service clients
(:mod:`fedps.shard_client`, :mod:`fedps.keyholder_client`, :mod:`fedps.coordinator_client`),
the servicers and the logs convert them, each with the ``to_proto`` / ``from_proto`` pair
beside the record. :class:`crypto.signed_update.SignedUpdate` lives in ``crypto/`` (which knows
no protobuf), so its conversion is the pair :func:`signed_update_to_proto` /
:func:`signed_update_from_proto`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from crypto.signed_update import SignedUpdate
from fedps.errors import InvalidArgumentError
from fedps.proto import common_pb2

__all__ = [
    "Aggregate",
    "Contribution",
    "MalformedReplyError",
    "ParameterBlock",
    "members_from_proto",
    "members_to_proto",
    "signed_update_from_proto",
    "signed_update_to_proto",
]


class MalformedReplyError(InvalidArgumentError):
    """A peer's reply cannot be one a correct peer sends (e.g. a client listed twice)."""


def signed_update_to_proto(update: SignedUpdate) -> common_pb2.SignedUpdate:
    """The wire form of a signed update."""
    return common_pb2.SignedUpdate(
        client_id=update.client_id,
        weight=update.weight,
        nonce=update.nonce,
        signature=update.signature,
        roots=list(update.roots),
        version=update.version,
    )


def signed_update_from_proto(message: common_pb2.SignedUpdate) -> SignedUpdate:
    """A signed update from its wire form (unknown fields are not part of it)."""
    return SignedUpdate(
        message.client_id,
        message.weight,
        bytes(message.nonce),
        bytes(message.signature),
        tuple(bytes(r) for r in message.roots),
        message.version,
    )


def members_to_proto(members: Mapping[str, bytes]) -> list[common_pb2.CohortMember]:
    """A cohort (client id -> Ed25519 public key) on the wire, by client id."""
    return [common_pb2.CohortMember(client_id=c, signing_key=k) for c, k in sorted(members.items())]


def members_from_proto(members: Iterable[common_pb2.CohortMember]) -> dict[str, bytes]:
    """A cohort from the wire: client id -> Ed25519 public key."""
    return {m.client_id: bytes(m.signing_key) for m in members}


@dataclass(frozen=True, slots=True)
class ParameterBlock:
    """One published block of the global model: float32 values and the key holder's
    signature (:func:`crypto.signing.model_block_digest`)."""

    block: int
    version: int
    values: bytes
    signature: bytes = b""

    def to_proto(self) -> common_pb2.ParameterBlock:
        """The wire form."""
        return common_pb2.ParameterBlock(
            block=self.block, version=self.version, values=self.values, signature=self.signature
        )

    @classmethod
    def from_proto(cls, message: common_pb2.ParameterBlock) -> ParameterBlock:
        """From the wire form."""
        return cls(message.block, message.version, bytes(message.values), bytes(message.signature))


@dataclass(frozen=True, slots=True)
class Contribution:
    """One manifest entry: who, with what weight, committed root, trained version and the
    staleness multiplier the shard applied (1 in sync mode)."""

    weight: float
    root: bytes
    version: int = 0
    multiplier: int = 1

    def to_proto(self, client_id: str) -> common_pb2.Contribution:
        """The wire form, naming the contributor."""
        return common_pb2.Contribution(
            client_id=client_id,
            weight=self.weight,
            root=self.root,
            version=self.version,
            multiplier=self.multiplier,
        )

    @classmethod
    def from_proto(cls, message: common_pb2.Contribution) -> Contribution:
        """From the wire form (the contributor's id is the caller's key)."""
        return cls(message.weight, bytes(message.root), message.version, message.multiplier)


@dataclass(frozen=True)
class Aggregate:
    """A closed round's encrypted sum for one block, with its manifest."""

    block: int
    ciphertext: bytes
    contributions: dict[str, Contribution]

    def to_proto(self) -> common_pb2.AggregateBlock:
        """The wire form, contributions by client id."""
        return common_pb2.AggregateBlock(
            block=self.block,
            ciphertext=self.ciphertext,
            contributions=[e.to_proto(c) for c, e in sorted(self.contributions.items())],
        )

    @classmethod
    def from_proto(cls, message: common_pb2.AggregateBlock) -> Aggregate:
        """From the wire form.

        Raises
        ------
        MalformedReplyError
            The manifest lists a client twice.
        """
        contributions = {c.client_id: Contribution.from_proto(c) for c in message.contributions}
        if len(contributions) != len(message.contributions):
            raise MalformedReplyError(
                f"block {message.block} lists {len(message.contributions)} contributions of "
                f"{len(contributions)} clients"
            )
        return cls(message.block, bytes(message.ciphertext), contributions)
