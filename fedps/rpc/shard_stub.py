"""The typed client of one shard: the wire twin of the shard's servicer.

One method per RPC of ``shard.proto``, taking and returning the plain records of
:mod:`fedps.rpc.shard_messages`; the channel (with fedps's limits, retry policy and, once
configured, mutual TLS), each call's deadline and the status -> exception mapping live here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from fedps.proto import common_pb2, shard_pb2, shard_pb2_grpc
from fedps.rpc.messages import MalformedReplyError, ParameterBlock
from fedps.rpc.service_call import invoke, stream_replies
from fedps.rpc.shard_messages import (
    AggregatePart,
    ClosedRound,
    HeldCiphertext,
    OpenedBlock,
    Publication,
    PushBatch,
    PushReceipt,
    RoundOpening,
    ShardStatus,
    TraceEvidence,
    TraceQuery,
)
from fedps.rpc.transport import create_channel

__all__ = ["CALL_S", "PULL_S", "PUSH_S", "ShardStub"]

#: Default deadline of a call (one caught in a shard's restart fails, then may be retried).
CALL_S = 20.0
#: Deadline of a push, and of the key holder's fetch and publish.
PUSH_S = 60.0
#: Deadline of one pull of the model.
PULL_S = 120.0


class ShardStub:
    """Calls one shard.

    Every method takes ``timeout_s``, the call's deadline; those that may wait out a
    restarting shard take ``retry_s``, how long a transient failure of the shard
    (unreachable, restarting, failed inside: :func:`fedps.rpc.transport.is_transient`) is retried
    (``None``: fail at once).

    Parameters
    ----------
    shard_id
        The shard's name (in error messages).
    address
        ``host:port``.
    """

    def __init__(self, shard_id: str, address: str) -> None:
        self.shard_id = shard_id
        self._channel = create_channel(address)
        self._stub = shard_pb2_grpc.ShardStub(self._channel)
        # PushBlocks with messages already encoded (the generated stub encodes them itself)
        self._push = self._channel.stream_unary(
            "/fedps.proto.Shard/PushBlocks",
            request_serializer=bytes,
            response_deserializer=shard_pb2.PushReply.FromString,
        )

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def open_round(
        self, opening: RoundOpening, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> None:
        """Open a round for a cohort (the coordinator's call)."""
        request = opening.to_proto()
        invoke(
            lambda: self._stub.OpenRound(request, timeout=timeout_s),
            f"open round on {self.shard_id}",
            retry_s,
        )

    def push_blocks(
        self,
        batches: Sequence[PushBatch],
        *,
        timeout_s: float = PUSH_S,
        retry_s: float | None = None,
    ) -> PushReceipt:
        """Stream one client's push messages; the receipt counts the bytes sent.

        Each message is sent as :meth:`~fedps.rpc.shard_messages.PushBatch.serialize` encodes
        it (its ciphertexts copied once), not built block by block into protobuf and encoded.
        """
        messages = [b.serialize() for b in batches]
        reply = invoke(
            lambda: self._push(iter(messages), timeout=timeout_s),
            f"push to {self.shard_id}",
            retry_s,
        )
        return PushReceipt.from_proto(reply, sum(len(m) for m in messages))

    def pull_blocks(
        self, min_version: int = 0, *, timeout_s: float = PULL_S
    ) -> list[ParameterBlock]:
        """Every block the shard owns at its current version (at least ``min_version``)."""
        request = shard_pb2.PullRequest(min_version=min_version)
        what = f"pull from {self.shard_id}"
        replies = invoke(lambda: self._stub.PullBlocks(request, timeout=timeout_s), what)
        return [
            ParameterBlock.from_proto(b)
            for reply in stream_replies(replies, what, timeout_s=timeout_s)
            for b in reply.blocks
        ]

    def close_round(
        self, round_: int, *, timeout_s: float = CALL_S, retry_s: float | None = None
    ) -> ClosedRound:
        """Stop accepting pushes for ``round_``; who pushed every block of this shard."""
        request = shard_pb2.CloseRoundRequest(round=round_)
        reply = invoke(
            lambda: self._stub.CloseRound(request, timeout=timeout_s),
            f"close round on {self.shard_id}",
            retry_s,
        )
        return ClosedRound.from_proto(reply)

    def discard_round(self, round_: int, *, timeout_s: float = CALL_S) -> None:
        """Drop an abandoned round's sums."""
        request = shard_pb2.CloseRoundRequest(round=round_)
        invoke(
            lambda: self._stub.DiscardRound(request, timeout=timeout_s),
            f"discard round on {self.shard_id}",
        )

    def fetch_aggregate(
        self, round_: int, contributors: Collection[str], *, timeout_s: float = PUSH_S
    ) -> Iterator[AggregatePart]:
        """The closed round's encrypted sums of exactly ``contributors``, as they stream in.

        With manifests and signed updates, message by message (the key holder checks each before it
        reads the next). The call starts now, not at the first read: the key holder starts every
        shard's fetch at once, and each shard sums while the key holder reads another's.
        """
        request = shard_pb2.FetchAggregateRequest(round=round_, contributors=sorted(contributors))
        what = f"fetch from {self.shard_id}"
        replies = invoke(lambda: self._stub.FetchAggregate(request, timeout=timeout_s), what)
        return (
            AggregatePart.from_proto(reply)
            for reply in stream_replies(replies, what, timeout_s=timeout_s)
        )

    def trace_blocks(
        self, query: TraceQuery, *, max_items: int, timeout_s: float = PUSH_S
    ) -> TraceEvidence:
        """The shard's evidence on some blocks of a closed round (after a failed check), all of it.

        Every message of the stream, joined.

        Raises
        ------
        MalformedReplyError
            The shard streamed more than ``max_items`` openings and ciphertexts (what was
            asked for bounds what a correct shard sends; the stream is cut there).
        """
        what = f"trace on {self.shard_id}"
        request = query.to_proto()
        replies = invoke(lambda: self._stub.TraceBlocks(request, timeout=timeout_s), what)
        openings: list[OpenedBlock] = []
        mismatches: list[HeldCiphertext] = []
        for reply in stream_replies(replies, what, timeout_s=timeout_s):
            part = TraceEvidence.from_proto(reply)
            openings += part.openings
            mismatches += part.mismatches
            if len(openings) + len(mismatches) > max_items:
                raise MalformedReplyError(f"{self.shard_id} sent more evidence than asked for")
        return TraceEvidence(tuple(openings), tuple(mismatches))

    def publish(self, messages: Sequence[Publication], *, timeout_s: float = PUSH_S) -> int:
        """Publish a new version of the shard's blocks (one or more messages, one header).

        Returns the number of blocks the shard installed.
        """
        requests = [m.to_proto() for m in messages]
        reply = invoke(
            lambda: self._stub.Publish(iter(requests), timeout=timeout_s),
            f"publish to {self.shard_id}",
        )
        return int(reply.blocks)

    def get_status(self, *, timeout_s: float = CALL_S) -> ShardStatus:
        """The shard's status (the operator's call)."""
        reply = invoke(
            lambda: self._stub.GetStatus(common_pb2.Empty(), timeout=timeout_s), self.shard_id
        )
        return ShardStatus.from_proto(reply)
