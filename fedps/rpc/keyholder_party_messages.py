"""The plain records of ``keyholder_party.proto``, each with its conversion to and from the wire.

:class:`~fedps.rpc.keyholder_party_stub.KeyHolderPartyStub` sends and receives them; the party's
servicer decodes into them; :class:`server.keyholder.keyholder_party.KeyHolderParty` never sees
protobuf.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from crypto.params import CANARIES
from crypto.threshold import request_digest
from fedps.proto import keyholder_party_pb2
from fedps.rpc.messages import Converter, MalformedReplyError, WireRecord, records_of

__all__ = [
    "ROWS_PER_MESSAGE",
    "AdoptRequest",
    "DecryptionRequest",
    "PartyCanaries",
    "PartyDeal",
    "PartyHello",
    "RekeyRequest",
    "join_partial",
    "split_partial",
]

#: Rows of a partial decryption per streamed message: 1 MiB at N = 2048.
ROWS_PER_MESSAGE = 64


@dataclass(frozen=True, slots=True)
class PartyCanaries(WireRecord[keyholder_party_pb2.PartyCanaries]):
    """One party's flooded canary partials of an aggregate (:mod:`crypto.joint_canary`), signed.

    Attributes
    ----------
    party
        The party's index.
    canaries
        ``(combinations, 32)`` little-endian uint64.
    signature
        The party's Ed25519 signature of :meth:`digest` under the request's digest.
    """

    wire = keyholder_party_pb2.PartyCanaries

    party: int
    canaries: bytes
    signature: bytes

    def digest(self, request: bytes) -> bytes:
        """What the party signs: the request's digest, its index and its canaries."""
        head = b"fedps-party-canaries-v1" + request + self.party.to_bytes(4, "little")
        return hashlib.sha256(head + self.canaries).digest()

    def values(self, combinations: int) -> np.ndarray:
        """The canaries, ``(combinations, 32)`` uint64.

        Raises
        ------
        MalformedReplyError
            The bytes are not that many values.
        """
        if len(self.canaries) != 8 * combinations * CANARIES:
            raise MalformedReplyError(f"party {self.party}'s canaries have the wrong size")
        words = np.frombuffer(self.canaries, dtype="<u8").astype(np.uint64)
        return words.reshape(combinations, CANARIES)


@dataclass(frozen=True, slots=True)
class DecryptionRequest(WireRecord[keyholder_party_pb2.PartialDecryptRequest]):
    """The combiner asks ``participants`` for partial decryptions of one round's aggregate.

    Attributes
    ----------
    round
        The closed round.
    contributors
        The clients the aggregate sums.
    participants
        The ``T`` parties that decrypt together (their Lagrange coefficients depend on it).
    aggregate
        :func:`crypto.threshold.aggregate_digest` of the aggregate the combiner verified.
    signature
        The combiner's Ed25519 signature of :meth:`digest`.
    canaries
        For a partial decryption: every participant's signed canary partials.
    """

    wire = keyholder_party_pb2.PartialDecryptRequest
    nested: ClassVar[Mapping[str, Converter]] = {"canaries": records_of(PartyCanaries)}

    round: int
    contributors: tuple[str, ...]
    participants: tuple[int, ...]
    aggregate: bytes
    signature: bytes
    canaries: tuple[PartyCanaries, ...] = ()

    def digest(self) -> bytes:
        """What the combiner signs (:func:`crypto.threshold.request_digest`)."""
        return request_digest(self.round, self.contributors, self.participants, self.aggregate)


@dataclass(frozen=True, slots=True)
class PartyHello(WireRecord[keyholder_party_pb2.PartyHello]):
    """Who a party is, and its joint public context once its key generation finished.

    Attributes
    ----------
    party
        The party's index.
    signing_key
        Its Ed25519 public key (of its canary partials).
    nonce
        Its contribution to the common seed of the key generation.
    context
        The joint public context's bytes; empty until the party finished its key generation.
    next_context
        A rotation's new joint public context, once the party holds its new share; empty
        otherwise.
    commitment
        Its commitment to its public share in the generation asked about, once it started
        it (:attr:`server.keyholder.party_key_generation.PartyKeyGeneration.commitment`);
        empty otherwise.
    """

    wire = keyholder_party_pb2.PartyHello

    party: int
    signing_key: bytes
    nonce: bytes
    context: bytes = b""
    next_context: bytes = b""
    commitment: bytes = b""


@dataclass(frozen=True, slots=True)
class RekeyRequest(WireRecord[keyholder_party_pb2.RekeyRequest]):
    """The combiner asks every party for a new collective key generation: a key rotation.

    Attributes
    ----------
    generation
        The rotation's number, above every earlier one (the combiner's last applied round).
    context_id
        The id of the joint context it replaces.
    signature
        The combiner's Ed25519 signature of :meth:`digest`.
    """

    wire = keyholder_party_pb2.RekeyRequest

    generation: int
    context_id: str
    signature: bytes = b""

    def digest(self) -> bytes:
        """What the combiner signs."""
        head = b"fedps-party-rekey-v1" + self.generation.to_bytes(8, "little")
        return hashlib.sha256(head + self.context_id.encode()).digest()


@dataclass(frozen=True, slots=True)
class AdoptRequest(WireRecord[keyholder_party_pb2.AdoptRequest]):
    """The combiner serves a rotation's new joint context: every party adopts its new share.

    Attributes
    ----------
    context_id
        The new joint context's id.
    signature
        The combiner's Ed25519 signature of :meth:`digest`.
    """

    wire = keyholder_party_pb2.AdoptRequest

    context_id: str
    signature: bytes = b""

    def digest(self) -> bytes:
        """What the combiner signs."""
        return hashlib.sha256(b"fedps-party-adopt-v1" + self.context_id.encode()).digest()


@dataclass(frozen=True, slots=True)
class PartyDeal(WireRecord[keyholder_party_pb2.PartyDeal]):
    """One party's public share and the Shamir share of its secret it dealt to the receiver.

    Attributes
    ----------
    sender
        The dealing party's index.
    seed_digest
        SHA-256 of the common seed the sender used.
    public_share
        ``b_j``: N little-endian uint64.
    dealt
        ``f_j(receiver)``: N little-endian uint64.
    """

    wire = keyholder_party_pb2.PartyDeal

    sender: int
    seed_digest: bytes
    public_share: bytes
    dealt: bytes

    @staticmethod
    def poly(data: bytes) -> np.ndarray:
        """A polynomial of the deal as uint64 (a copy: writable, native order)."""
        return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def split_partial(partial: np.ndarray) -> Iterator[keyholder_party_pb2.PartialDecryptReply]:
    """A partial decryption, ``(B, N)`` uint64, as streamed messages of :data:`ROWS_PER_MESSAGE`."""
    for first in range(0, len(partial), ROWS_PER_MESSAGE):
        rows = partial[first : first + ROWS_PER_MESSAGE]
        yield keyholder_party_pb2.PartialDecryptReply(
            first=first, partial=np.ascontiguousarray(rows, dtype="<u8").tobytes()
        )


def join_partial(replies: Iterable[keyholder_party_pb2.PartialDecryptReply], n: int) -> np.ndarray:
    """The ``(B, N)`` uint64 partial decryption of streamed messages, in order.

    Raises
    ------
    MalformedReplyError
        A message is out of order or not whole rows of ``n`` coefficients.
    """
    parts: list[np.ndarray] = []
    rows = 0
    for reply in replies:
        if reply.first != rows or len(reply.partial) % (8 * n):
            raise MalformedReplyError("a partial decryption's rows are out of order or cut")
        part = np.frombuffer(reply.partial, dtype="<u8").astype(np.uint64).reshape(-1, n)
        parts.append(part)
        rows += len(part)
    return np.concatenate(parts) if parts else np.zeros((0, n), dtype=np.uint64)
