"""The plain records of ``common.proto`` and their one conversion to and from the wire.

Role classes take and return these frozen dataclasses; only the typed service clients
(:mod:`fedps.rpc.shard_stub`, :mod:`fedps.rpc.keyholder_stub`, :mod:`fedps.rpc.coordinator_stub`),
the servicers and the logs convert them, each with the ``to_proto`` / ``from_proto`` pair
beside the record. :class:`crypto.signed_update.SignedUpdate` lives in ``crypto/`` (which knows
no protobuf), so its conversion is the pair :func:`signed_update_to_proto` /
:func:`signed_update_from_proto`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

from google.protobuf.message import Message

from crypto.signed_update import SignedUpdate
from fedps.errors import InvalidArgumentError
from fedps.proto import common_pb2

__all__ = [
    "COMMITMENTS",
    "MEMBERS",
    "SIGNED_UPDATE",
    "SIGNED_UPDATES",
    "Aggregate",
    "Contribution",
    "Converter",
    "MalformedReplyError",
    "ParameterBlock",
    "WireRecord",
    "framed",
    "from_message",
    "members_from_proto",
    "members_to_proto",
    "records_of",
    "signed_update_from_proto",
    "signed_update_to_proto",
    "to_message",
    "varint_field",
]

_M = TypeVar("_M", bound=Message)
_R = TypeVar("_R")


class MalformedReplyError(InvalidArgumentError):
    """A peer's reply cannot be one a correct peer sends (e.g. a client listed twice)."""


def to_message(message_type: type[_M], record: Any, **converted: Any) -> _M:
    """The wire form of ``record``.

    Each of its fields that ``message_type`` has, by name; ``converted`` gives the fields that need
    converting first (nested messages).
    """
    values = {name: getattr(record, name) for name in _shared_fields(type(record), message_type)}
    return message_type(**(values | converted))


def from_message(cls: type[_R], message: Message, **converted: Any) -> _R:
    """A record of type ``cls`` from its wire form.

    Each of its fields that ``message`` has, by name (repeated fields as tuples, maps as dicts);
    ``converted`` gives the fields that need converting first (nested messages).
    """
    values = {
        name: _plain(getattr(message, name))
        for name in _shared_fields(cls, type(message))
        if name not in converted
    }
    return cls(**(values | converted))


_SHARED_FIELDS: dict[tuple[type[Any], type[Message]], tuple[str, ...]] = {}


def _shared_fields(record_type: type[Any], message_type: type[Message]) -> tuple[str, ...]:
    """The fields of the dataclass ``record_type`` that ``message_type`` has too, by name.

    Worked out once per pair: records cross the wire by the thousand (a manifest entry per
    contributor and block).
    """
    key = (record_type, message_type)
    shared = _SHARED_FIELDS.get(key)
    if shared is None:
        names = message_type.DESCRIPTOR.fields_by_name
        shared = tuple(f.name for f in fields(record_type) if f.name in names)
        _SHARED_FIELDS[key] = shared
    return shared


def varint_field(field: int, value: int) -> bytes:
    """Protobuf field number ``field`` holding the integer ``value`` (>= 0), encoded."""
    return _varint(field << 3) + _varint(value)


def framed(field: int, *parts: bytes) -> list[bytes]:
    """Protobuf field number ``field`` holding ``parts`` joined (bytes, or an encoded message).

    Its key and length, then the parts themselves: joined with what comes before and after, an
    encoded message around a large payload without copying the payload into protobuf. Protobuf
    reads encodings written one after the other as one message (repeated fields appended), so a
    message's small fields can be encoded by protobuf and its large ones framed here.
    """
    return [_varint(field << 3 | 2), _varint(sum(len(p) for p in parts)), *parts]


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint: 7 bits a byte, least significant first."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: How one field crosses the wire: (to the wire, from the wire).
Converter = tuple[Callable[[Any], Any], Callable[[Any], Any]]


class WireRecord(Generic[_M]):
    """A frozen dataclass whose wire form is the message type :attr:`wire`, field for field by name.

    The fields in :attr:`nested` are converted with their pair of functions.
    """

    __slots__ = ()
    #: the protobuf message type of the record's wire form
    wire: ClassVar[type[Message]]
    #: the fields that need converting (nested messages), by name
    nested: ClassVar[Mapping[str, Converter]] = {}

    def to_proto(self) -> _M:
        """The wire form."""
        converted = {name: out(getattr(self, name)) for name, (out, _) in self.nested.items()}
        return cast(_M, to_message(self.wire, self, **converted))

    @classmethod
    def taken_from(cls, source: Any, **given: Any) -> Self:
        """The record of the fields of the same names in ``source``.

        ``source`` is a richer record of the role that produced it; ``given`` supplies fields
        ``source`` does not have.
        """
        taken = {
            f.name: getattr(source, f.name) for f in fields(cast(Any, cls)) if f.name not in given
        }
        return cls(**(taken | given))

    @classmethod
    def from_proto(cls, message: _M) -> Self:
        """From the wire form."""
        converted = {name: back(getattr(message, name)) for name, (_, back) in cls.nested.items()}
        return from_message(cls, message, **converted)


def _plain(value: Any) -> Any:
    """A protobuf field's value as plain Python.

    Scalars as they are, a map as a dict, a repeated field as a tuple.
    """
    if isinstance(value, str | bytes | int | float):
        return value
    return dict(value) if hasattr(value, "keys") else tuple(value)


def signed_update_to_proto(update: SignedUpdate) -> common_pb2.SignedUpdate:
    """The wire form of a signed update."""
    return to_message(common_pb2.SignedUpdate, update)


def signed_update_from_proto(message: common_pb2.SignedUpdate) -> SignedUpdate:
    """A signed update from its wire form (unknown fields are not part of it)."""
    return from_message(SignedUpdate, message)


def members_to_proto(members: Mapping[str, bytes]) -> list[common_pb2.CohortMember]:
    """A cohort (client id -> Ed25519 public key) on the wire, by client id."""
    return [common_pb2.CohortMember(client_id=c, signing_key=k) for c, k in sorted(members.items())]


def members_from_proto(members: Iterable[common_pb2.CohortMember]) -> dict[str, bytes]:
    """A cohort from the wire: client id -> Ed25519 public key."""
    return {m.client_id: bytes(m.signing_key) for m in members}


#: A cohort (client id -> Ed25519 public key), by client id on the wire.
MEMBERS: Converter = (members_to_proto, members_from_proto)
#: One signed update.
SIGNED_UPDATE: Converter = (signed_update_to_proto, signed_update_from_proto)
#: Signed updates, in order.
SIGNED_UPDATES: Converter = (
    lambda updates: [signed_update_to_proto(u) for u in updates],
    lambda messages: tuple(signed_update_from_proto(m) for m in messages),
)
#: Signed updates by client id (in client-id order on the wire).
COMMITMENTS: Converter = (
    lambda updates: [signed_update_to_proto(u) for _, u in sorted(updates.items())],
    lambda messages: {m.client_id: signed_update_from_proto(m) for m in messages},
)


def records_of(record_type: type[WireRecord[Any]] | type[Aggregate]) -> Converter:
    """A repeated field of nested records of ``record_type``, as a tuple."""
    return (
        lambda records: [r.to_proto() for r in records],
        lambda messages: tuple(record_type.from_proto(m) for m in messages),
    )


@dataclass(frozen=True, slots=True)
class ParameterBlock(WireRecord[common_pb2.ParameterBlock]):
    """One published block of the global model.

    Float32 values and the key holder's signature (:func:`crypto.signing.model_block_digest`).
    """

    wire = common_pb2.ParameterBlock

    block: int
    version: int
    values: bytes
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class Contribution:
    """One manifest entry.

    Who, with what weight, committed root, trained version and the staleness multiplier the shard
    applied (1 in sync mode).
    """

    weight: float
    root: bytes
    version: int = 0
    multiplier: int = 1

    def to_proto(self, client_id: str) -> common_pb2.Contribution:
        """The wire form, naming the contributor."""
        return to_message(common_pb2.Contribution, self, client_id=client_id)

    @classmethod
    def from_proto(cls, message: common_pb2.Contribution) -> Contribution:
        """From the wire form (the contributor's id is the caller's key)."""
        return from_message(cls, message)


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
