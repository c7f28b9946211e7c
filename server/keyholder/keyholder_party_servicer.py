"""gRPC face of :class:`server.keyholder.keyholder_party.KeyHolderParty`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from fedps.proto import keyholder_party_pb2, keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import DecryptionRequest, split_partial
from fedps.rpc.transport import rpc_errors
from server.keyholder.keyholder_party import KeyHolderParty

__all__ = ["KeyHolderPartyServicer"]


class KeyHolderPartyServicer(keyholder_party_pb2_grpc.KeyHolderPartyServicer):
    """Thin servicer over a :class:`KeyHolderParty`."""

    def __init__(self, party: KeyHolderParty) -> None:
        self.party = party

    def CanaryPartial(  # noqa: N802 (gRPC method name)
        self, request: keyholder_party_pb2.PartialDecryptRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.PartyCanaries:
        """Combiner: the party checks the round itself, then signs its canary partials."""
        with rpc_errors(context):
            return self.party.canary_partial(DecryptionRequest.from_proto(request)).to_proto()

    def PartialDecrypt(  # noqa: N802
        self, request: keyholder_party_pb2.PartialDecryptRequest, context: grpc.ServicerContext
    ) -> Iterator[keyholder_party_pb2.PartialDecryptReply]:
        """Combiner: the party checks the round itself, then streams its partial decryption."""
        with rpc_errors(context):
            partial = self.party.partial_decrypt(DecryptionRequest.from_proto(request))
        yield from split_partial(partial)
