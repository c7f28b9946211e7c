"""The typed client of a key-holder party: the wire twin of the party's servicer.

:class:`KeyHolderPartyStub` is what the combiner
(:class:`server.keyholder.joint_decryptor.JointDecryptor`) calls; a party that cannot be
reached, or does not answer within the deadline, raises
:class:`~fedps.errors.PeerUnavailableError`, and a party's refusal its own error again
(``PolicyError``: the round failed the party's check).
"""

from __future__ import annotations

import numpy as np

from fedps.proto import keyholder_party_pb2, keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import (
    AdoptRequest,
    DecryptionRequest,
    PartyCanaries,
    PartyDeal,
    PartyHello,
    RekeyRequest,
    join_partial,
)
from fedps.rpc.service_call import invoke, stream_replies
from fedps.rpc.transport import create_channel

__all__ = ["DECRYPT_S", "KeyHolderPartyStub"]

#: Deadline of a key-generation call (a hello, a deal).
KEYGEN_S = 10.0

#: Deadline of one partial decryption (the party fetches and hashes the round's aggregate).
DECRYPT_S = 300.0

#: Deadline of a prepare (the party checks its signature and starts a thread).
PREPARE_S = 10.0


class KeyHolderPartyStub:
    """Calls the key-holder party at ``address``.

    Parameters
    ----------
    address
        The party's ``host:port``.
    n
        The ring dimension N (the length of a partial's rows).
    timeout_s
        The deadline of each call.
    """

    def __init__(self, address: str, *, n: int, timeout_s: float = DECRYPT_S) -> None:
        self._channel = create_channel(address)
        self._stub = keyholder_party_pb2_grpc.KeyHolderPartyStub(self._channel)
        self._n = n
        self._timeout_s = timeout_s

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries:
        """The party's signed canary partials of the round's aggregate."""
        message = request.to_proto()
        reply = invoke(
            lambda: self._stub.CanaryPartial(message, timeout=self._timeout_s),
            f"canaries of round {request.round}",
        )
        return PartyCanaries.from_proto(reply)

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray:
        """The party's partial decryption of the round's aggregate, ``(B, N)`` uint64."""
        what = f"partial decryption of round {request.round}"
        message = request.to_proto()
        replies = invoke(lambda: self._stub.PartialDecrypt(message, timeout=self._timeout_s), what)
        return join_partial(stream_replies(replies, what, timeout_s=self._timeout_s), self._n)

    def prepare(self, request: DecryptionRequest) -> bool:
        """Have the party prepare the round ahead; whether it started (it releases nothing)."""
        message = request.to_proto()
        reply = invoke(
            lambda: self._stub.Prepare(message, timeout=PREPARE_S),
            f"prepare of round {request.round}",
        )
        return bool(reply.started)

    def hello(self, generation: int = 0) -> PartyHello:
        """Who the party is (its nonce of ``generation``), and its joint public context(s)."""
        message = keyholder_party_pb2.PartyHelloRequest(generation=generation)
        reply = invoke(lambda: self._stub.Hello(message, timeout=KEYGEN_S), "party hello")
        return PartyHello.from_proto(reply)

    def rekey(self, request: RekeyRequest) -> bool:
        """Have the party start a key rotation's generation; whether it started."""
        message = request.to_proto()
        reply = invoke(lambda: self._stub.Rekey(message, timeout=KEYGEN_S), "key rotation")
        return bool(reply.started)

    def adopt(self, request: AdoptRequest) -> bool:
        """Have the party adopt the rotated key; whether anything changed."""
        message = request.to_proto()
        reply = invoke(lambda: self._stub.Adopt(message, timeout=KEYGEN_S), "key adoption")
        return bool(reply.adopted)

    def deal(self, deal: PartyDeal) -> None:
        """Hand the party the deal of party ``deal.sender`` (only over an authenticated channel)."""
        message = deal.to_proto()
        invoke(lambda: self._stub.Deal(message, timeout=KEYGEN_S), "key generation deal")
