"""The typed client of the coordinator: the wire twin of the coordinator's servicer.

One method per RPC of ``coordinator.proto``, taking and returning the plain records of
:mod:`fedps.rpc.coordinator_messages`; the channel, each call's deadline, the status -> exception
mapping, the wait for a restarting coordinator (``retry_s``) and the credential issued at
registration (sent on every later call) live here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import Message

from fedps.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from fedps.rpc.coordinator_messages import (
    CREDENTIAL_HEADER,
    Assignment,
    AssignmentQuery,
    ClientRegistration,
    ClosedRound,
    ClusterStatus,
    RegistrationReply,
    UpdateReport,
)
from fedps.rpc.service_call import invoke
from fedps.rpc.transport import create_channel

__all__ = ["CALL_S", "CoordinatorStub"]

_T = TypeVar("_T")

#: Default deadline of a call.
CALL_S = 20.0


class CoordinatorStub:
    """Calls the coordinator at ``address``.

    Every method takes ``timeout_s``, the call's deadline; those a client makes take
    ``retry_s``: how long a transient failure of the coordinator (unreachable, restarting,
    failed inside: :func:`fedps.rpc.transport.is_transient`) is retried (``None``: fail at once).
    """

    def __init__(self, address: str) -> None:
        self._channel = create_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        #: the credential of the last registration (empty before one)
        self.credential = b""

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def register(
        self,
        registration: ClientRegistration,
        *,
        timeout_s: float = CALL_S,
        retry_s: float | None = None,
    ) -> RegistrationReply:
        """Register; the credential the coordinator issues (if any) is sent from now on."""
        request = registration.to_proto()
        reply = invoke(lambda: self._stub.Register(request, timeout=timeout_s), "register", retry_s)
        registered = RegistrationReply.from_proto(reply)
        if registered.credential:
            self.credential = registered.credential
        return registered

    def get_task(
        self, query: AssignmentQuery, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> Assignment:
        """The caller's next task (the query carries its recorded privacy spend)."""
        reply = self._with_credential(
            self._stub.GetTask, query.to_proto(), "get task", timeout_s, retry_s
        )
        return Assignment.from_proto(reply)

    def report_update(
        self, report: UpdateReport, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> None:
        """Report a round's part: spend, bytes pushed, budget, noise multiplier."""
        self._with_credential(
            self._stub.ReportUpdate, report.to_proto(), "report", timeout_s, retry_s
        )

    def get_status(self, *, timeout_s: float = CALL_S) -> ClusterStatus:
        """The run's status (the operator's call)."""
        reply = invoke(
            lambda: self._stub.GetStatus(common_pb2.Empty(), timeout=timeout_s),
            "coordinator status",
        )
        return ClusterStatus.from_proto(reply)

    def remove_shard(self, shard_id: str, *, timeout_s: float = CALL_S) -> None:
        """Remove ``shard_id`` from the ring for good (the operator's call)."""
        request = coordinator_pb2.RemoveShardRequest(shard_id=shard_id)
        invoke(lambda: self._stub.RemoveShard(request, timeout=timeout_s), f"remove {shard_id}")

    def join_shard(self, shard_id: str, *, timeout_s: float = CALL_S) -> None:
        """Add the empty shard ``shard_id`` to the ring at the next round (the operator's call)."""
        request = coordinator_pb2.JoinShardRequest(shard_id=shard_id)
        invoke(lambda: self._stub.JoinShard(request, timeout=timeout_s), f"join {shard_id}")

    def get_closed_round(self, round_: int, *, timeout_s: float = CALL_S) -> ClosedRound:
        """The clients ``round_`` closed with and the ring it is applied on (a party's call)."""
        request = coordinator_pb2.ClosedRoundRequest(round=round_)
        reply = invoke(
            lambda: self._stub.GetClosedRound(request, timeout=timeout_s),
            f"closed round {round_}",
        )
        return ClosedRound.from_proto(reply)

    def _with_credential(
        self,
        rpc: Callable[..., _T],
        request: Message,
        what: str,
        timeout_s: float,
        retry_s: float | None,
    ) -> _T:
        """Call ``rpc`` with the credential, read at every attempt.

        None before a registration issued one.
        """
        return invoke(
            lambda: rpc(request, metadata=self._metadata(), timeout=timeout_s), what, retry_s
        )

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CREDENTIAL_HEADER, self.credential.hex()),) if self.credential else ()
