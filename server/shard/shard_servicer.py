"""gRPC face of :class:`server.shard.shard.Shard`: decode messages, call the handler, map errors.

Under mutual TLS a push must come from the certificate whose name is the push's client id.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np

from fedps.errors import FedPSError, InvalidArgumentError
from fedps.proto import common_pb2, shard_pb2, shard_pb2_grpc
from fedps.rpc import shard_messages as records
from fedps.rpc.messages import ParameterBlock
from fedps.rpc.transport import batched, require_peer, rpc_errors
from fedps.sharding.ring_view import RingView
from server.metrics import ShardMetrics
from server.shard.shard import Shard

__all__ = ["ShardServicer"]


class ShardServicer(shard_pb2_grpc.ShardServicer):
    """Thin servicer over a :class:`Shard`."""

    def __init__(self, shard: Shard, metrics: ShardMetrics | None = None) -> None:
        self.shard = shard
        self._metrics = metrics

    def OpenRound(  # noqa: N802 (gRPC method name)
        self, request: shard_pb2.OpenRoundRequest, context: grpc.ServicerContext
    ) -> shard_pb2.OpenRoundReply:
        """Coordinator: open a round on a model version for a cohort."""
        with rpc_errors(context):
            self.shard.open_opening(records.RoundOpening.from_proto(request))
        return shard_pb2.OpenRoundReply()

    def PushBlocks(  # noqa: N802
        self, request_iterator: Iterator[shard_pb2.PushRequest], context: grpc.ServicerContext
    ) -> shard_pb2.PushReply:
        """Client: a stream of encrypted blocks for the open round."""
        accepted = duplicates = 0
        metrics = self._metrics
        first: records.PushBatch | None = None  # later messages take its commitment
        with rpc_errors(context):
            for message in request_iterator:
                started = time.perf_counter()
                try:
                    require_peer(context, message.client_id)
                    batch = records.PushBatch.from_proto(message).inheriting(first)
                    first = first or batch
                    a, d = self.shard.push(batch)
                except (FedPSError, ValueError) as exc:
                    if metrics is not None:
                        metrics.push_refused(exc)
                    raise
                if metrics is not None:
                    nbytes = sum(len(b.ciphertext) for b in message.blocks)
                    metrics.push_accepted(a, d, nbytes, time.perf_counter() - started)
                accepted += a
                duplicates += d
        return records.PushReceipt(accepted, duplicates).to_proto()

    def PullBlocks(  # noqa: N802
        self, request: shard_pb2.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[shard_pb2.PullReply]:
        """Anyone: the current plaintext blocks this shard owns, streamed."""
        with rpc_errors(context):
            version, blocks = self.shard.model.pull(request.min_version)
        items = sorted(blocks.items())
        for batch in batched(items, lambda item: len(item[1])):
            yield shard_pb2.PullReply(
                blocks=[
                    ParameterBlock(b, version, v, self.shard.model.signature_of(b)).to_proto()
                    for b, v in batch
                ]
            )

    def CloseRound(  # noqa: N802
        self, request: shard_pb2.CloseRoundRequest, context: grpc.ServicerContext
    ) -> shard_pb2.CloseRoundReply:
        """Coordinator: stop accepting pushes for a round; reports who contributed."""
        with rpc_errors(context):
            complete = self.shard.close_round(request.round)
        return records.ClosedRound(tuple(complete), len(self.shard.update_blocks)).to_proto()

    def DiscardRound(  # noqa: N802
        self, request: shard_pb2.CloseRoundRequest, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """Coordinator: drop an abandoned round's sums without ever decrypting them."""
        with rpc_errors(context):
            self.shard.discard_round(request.round)
        return common_pb2.Empty()

    def FetchAggregate(  # noqa: N802
        self, request: shard_pb2.FetchAggregateRequest, context: grpc.ServicerContext
    ) -> Iterator[shard_pb2.FetchAggregateReply]:
        """Key holder: the closed round's sums of exactly the named contributors, streamed."""
        with rpc_errors(context):
            aggregates, updates = self.shard.aggregates(request.round, request.contributors)
        for chunk in batched(updates, lambda u: 32 * len(u.roots) + 256):
            yield records.AggregatePart(updates=tuple(chunk)).to_proto()
        # A block's manifest lists every contributor: count it in the message size, so a
        # round of many clients streams in bounded messages (and bounded memory).
        for batch in batched(aggregates, lambda a: len(a.ciphertext) + 96 * len(a.contributions)):
            yield records.AggregatePart(blocks=tuple(batch)).to_proto()

    def TraceBlocks(  # noqa: N802
        self, request: shard_pb2.TraceRequest, context: grpc.ServicerContext
    ) -> Iterator[shard_pb2.TraceReply]:
        """Key holder, after a failed check: the evidence on some blocks of a closed round."""
        with rpc_errors(context):
            openings, mismatches = self.shard.trace(records.TraceQuery.from_proto(request))
        for batch in batched(openings, lambda o: len(o.c1) + 512):
            yield records.TraceEvidence(openings=tuple(batch)).to_proto()
        for held in batched(mismatches, lambda m: len(m.ciphertext) + 64):
            yield records.TraceEvidence(mismatches=tuple(held)).to_proto()

    def Publish(  # noqa: N802
        self, request_iterator: Iterator[shard_pb2.PublishRequest], context: grpc.ServicerContext
    ) -> shard_pb2.PublishReply:
        """Key holder: publish a new version of this shard's blocks."""
        with rpc_errors(context):
            blocks: dict[int, np.ndarray] = {}
            signatures: dict[int, bytes] = {}
            header: tuple[int, int, int] | None = None
            ring = RingView()
            for message in request_iterator:
                part = records.Publication.from_proto(message)
                ring = RingView.of(part)
                this = (part.version, part.num_blocks, part.values_per_block)
                if header is not None and this != header:
                    raise InvalidArgumentError("publish messages disagree on the version")
                header = this
                for block in part.blocks:
                    blocks[block.block] = np.frombuffer(block.values, dtype="<f4")
                    signatures[block.block] = block.signature
            if header is None:
                raise InvalidArgumentError("empty publish")
            count = self.shard.model.publish(
                header[0], header[1], header[2], blocks, signatures, ring=ring
            )
        return shard_pb2.PublishReply(blocks=count)

    def GetStatus(  # noqa: N802
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> shard_pb2.ShardStatus:
        """What the shard reports to the operator."""
        return self.shard.status().to_proto()
