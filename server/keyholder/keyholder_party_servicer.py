"""gRPC face of :class:`server.keyholder.keyholder_party.KeyHolderParty`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import grpc
import numpy as np

from fedps.errors import NotReadyError
from fedps.proto import keyholder_party_pb2, keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import (
    AdoptRequest,
    DecryptionRequest,
    PartyCanaries,
    PartyDeal,
    PartyHello,
    RekeyRequest,
    split_partial,
)
from fedps.rpc.transport import peer_common_name, rpc_errors
from server.metrics import PartyMetrics

__all__ = ["KeyHolderPartyServicer"]

_T = TypeVar("_T")


class _Decrypting(Protocol):
    def canary_partial(self, request: DecryptionRequest) -> PartyCanaries: ...

    def partial_decrypt(self, request: DecryptionRequest) -> np.ndarray: ...

    def prepare(self, request: DecryptionRequest) -> bool: ...


class _Generating(Protocol):
    def hello(self, generation: int = 0) -> PartyHello: ...

    def receive_deal(self, deal: PartyDeal, caller: str | None) -> None: ...

    def rekey(self, request: RekeyRequest) -> bool: ...

    def adopt(self, request: AdoptRequest) -> bool: ...


class KeyHolderPartyServicer(keyholder_party_pb2_grpc.KeyHolderPartyServicer):
    """Thin servicer over a party (a :class:`KeyHolderParty`, or a party process).

    Parameters
    ----------
    party
        What answers the combiner's requests.
    keygen
        What answers the other parties in the key generation (a
        :class:`~.party_process.PartyProcess`); None: a party whose keys were made elsewhere.
    metrics
        Where the combiner's requests are counted (None: nowhere).
    """

    def __init__(
        self,
        party: _Decrypting,
        keygen: _Generating | None = None,
        metrics: PartyMetrics | None = None,
    ) -> None:
        self.party = party
        self.keygen = keygen
        self._metrics = metrics

    def _counted(self, kind: str, answer: Callable[[], _T]) -> _T:
        """``answer()``, counted as a request of ``kind`` answered or refused."""
        started = time.perf_counter()
        try:
            out = answer()
        except Exception as exc:
            if self._metrics is not None:
                self._metrics.refused(kind, exc)
            raise
        if self._metrics is not None:
            self._metrics.answered(kind, time.perf_counter() - started)
        return out

    def CanaryPartial(  # noqa: N802 (gRPC method name)
        self, request: keyholder_party_pb2.PartialDecryptRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.PartyCanaries:
        """Combiner: the party checks the round itself, then signs its canary partials."""
        with rpc_errors(context):
            asked = DecryptionRequest.from_proto(request)
            return self._counted("canaries", lambda: self.party.canary_partial(asked)).to_proto()

    def PartialDecrypt(  # noqa: N802
        self, request: keyholder_party_pb2.PartialDecryptRequest, context: grpc.ServicerContext
    ) -> Iterator[keyholder_party_pb2.PartialDecryptReply]:
        """Combiner: the party checks the round itself, then streams its partial decryption."""
        with rpc_errors(context):
            asked = DecryptionRequest.from_proto(request)
            partial = self._counted("partial", lambda: self.party.partial_decrypt(asked))
        yield from split_partial(partial)

    def Prepare(  # noqa: N802
        self, request: keyholder_party_pb2.PartialDecryptRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.PrepareReply:
        """Combiner: the party starts fetching the round and computing ahead; nothing leaves."""
        with rpc_errors(context):
            asked = DecryptionRequest.from_proto(request)
            started = self._counted("prepare", lambda: self.party.prepare(asked))
            return keyholder_party_pb2.PrepareReply(started=started)

    def Hello(  # noqa: N802
        self, request: keyholder_party_pb2.PartyHelloRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.PartyHello:
        """Parties and the combiner: who this party is, and its joint context once made."""
        with rpc_errors(context):
            return self._keygen().hello(request.generation).to_proto()

    def Deal(  # noqa: N802
        self, request: keyholder_party_pb2.PartyDeal, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.PartyDealReply:
        """Another party: its deal to this one, checked against the caller's certificate."""
        with rpc_errors(context):
            deal = PartyDeal.from_proto(request)
            self._keygen().receive_deal(deal, peer_common_name(context))
            return keyholder_party_pb2.PartyDealReply()

    def Rekey(  # noqa: N802
        self, request: keyholder_party_pb2.RekeyRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.RekeyReply:
        """Combiner: a key rotation's new collective generation (the current share kept)."""
        with rpc_errors(context):
            started = self._keygen().rekey(RekeyRequest.from_proto(request))
            return keyholder_party_pb2.RekeyReply(started=started)

    def Adopt(  # noqa: N802
        self, request: keyholder_party_pb2.AdoptRequest, context: grpc.ServicerContext
    ) -> keyholder_party_pb2.AdoptReply:
        """Combiner: the rotated key is served; the party replaces its share by the new one."""
        with rpc_errors(context):
            adopted = self._keygen().adopt(AdoptRequest.from_proto(request))
            return keyholder_party_pb2.AdoptReply(adopted=adopted)

    def _keygen(self) -> _Generating:
        if self.keygen is None:
            raise NotReadyError("this party takes no part in a key generation")
        return self.keygen
