"""gRPC face of :class:`server.keyholder.keyholder.KeyHolder`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np

from crypto import PLAINTEXT_CONTEXT_ID
from crypto.signing import context_digest
from fedps.errors import FedPSError, InvalidArgumentError, PolicyError
from fedps.proto import common_pb2, keyholder_pb2, keyholder_pb2_grpc
from fedps.round_timer import RoundTimer
from fedps.rpc import keyholder_messages as records
from fedps.rpc.transport import require_peer, rpc_errors
from fedps.sharding.blocks import BlockLayout
from fedps.sharding.ring_view import RingView
from server.keyholder.keyholder import MAX_PARAMS, KeyHolder
from server.metrics import KeyHolderMetrics

__all__ = ["KeyHolderServicer"]


class KeyHolderServicer(keyholder_pb2_grpc.KeyHolderServicer):
    """Thin servicer over a :class:`KeyHolder`."""

    def __init__(self, keyholder: KeyHolder, metrics: KeyHolderMetrics | None = None) -> None:
        self.keyholder = keyholder
        self._metrics = metrics
        self._context_reply: keyholder_pb2.PublicContextReply | None = None

    def GetPublicContext(  # noqa: N802 (gRPC method name)
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> keyholder_pb2.PublicContextReply:
        """The public context, its id, the signing key and its signature of them."""
        public = self.keyholder.keys.public  # once: a rotation may replace the keys meanwhile
        encrypted = self.keyholder.settings.encrypted
        context_id = public.context_id if encrypted else PLAINTEXT_CONTEXT_ID
        cached = self._context_reply
        if cached is not None and cached.context_id == context_id:
            return cached  # serialised and signed once per key generation
        context_bytes = public.serialize() if encrypted else b""
        signer = self.keyholder.signer
        reply = records.PublicContextInfo(
            context=context_bytes,
            context_id=context_id,
            signing_key=signer.public_key,
            signature=signer.sign(context_digest(context_bytes, context_id)),
        ).to_proto()
        self._context_reply = reply
        return reply

    def InitializeModel(  # noqa: N802
        self,
        request_iterator: Iterator[keyholder_pb2.InitializeRequest],
        context: grpc.ServicerContext,
    ) -> keyholder_pb2.ModelState:
        """Chief: set the initial model, unless the key holder already has one."""
        with rpc_errors(context):
            blocks: dict[int, np.ndarray] = {}
            num_params = 0
            force = False
            version = 0
            ring = RingView()
            for message in request_iterator:
                upload = records.ModelUpload.from_proto(message)
                num_params, force, version = upload.num_params, upload.force, upload.version
                ring = RingView.of(upload)
                for block in upload.blocks:
                    blocks[block.block] = np.frombuffer(block.values, dtype="<f4")
            if not 0 < num_params <= MAX_PARAMS:
                raise InvalidArgumentError(f"a model has 1..{MAX_PARAMS} parameters")
            layout = BlockLayout(num_params, self.keyholder.keys.public.params.values_per_block)
            self.keyholder.follow_ring(ring)  # a restarted chief's ring: publish on it
            self.keyholder.initialize(layout.join(blocks), version=version, force=force)
        return self.GetModelState(common_pb2.Empty(), context)

    def ApplyRound(  # noqa: N802
        self, request: keyholder_pb2.ApplyRoundRequest, context: grpc.ServicerContext
    ) -> keyholder_pb2.ApplyRoundReply:
        """Coordinator: decrypt a closed round's sums, apply them, publish the next version."""
        started = time.perf_counter()
        timer = RoundTimer()
        with rpc_errors(context):
            r = records.RoundApplication.from_proto(request)
            self.keyholder.follow_ring(RingView.of(r))  # the ring the round closed on
            try:
                result = self.keyholder.apply_round(
                    r.round, r.version, r.run_id, r.members, timer=timer
                )
            except PolicyError as exc:
                if self._metrics is not None:
                    self._metrics.round_refused(exc)
                raise
        if self._metrics is not None:
            self._metrics.latency.labels("apply").observe(time.perf_counter() - started)
        applied = records.AppliedRound.taken_from(
            result, phase_seconds=timer.seconds(), contributors=tuple(sorted(result.contributors))
        )
        return applied.to_proto()

    def OpenCommits(  # noqa: N802
        self, request: keyholder_pb2.OpenCommitsRequest, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """Coordinator: start collecting a cohort's commitments for a round (or async buffer)."""
        with rpc_errors(context):
            o = records.CommitOpening.from_proto(request)
            self.keyholder.follow_ring(RingView.of(o))  # its clients pull from this ring
            self.keyholder.open_commits(o.round, o.version, o.run_id, o.context_id, o.members)
        return common_pb2.Empty()

    def GetChallenge(  # noqa: N802
        self, request: keyholder_pb2.ChallengeRequest, context: grpc.ServicerContext
    ) -> keyholder_pb2.Challenge:
        """Cohort member: the round's secret challenge, and the pad seed of its ciphertexts."""
        with rpc_errors(context):
            require_peer(context, request.client_id)
            commits = self.keyholder.commits
            seed = commits.challenge_seed(request.round, request.client_id)
            pad_seed = commits.pad_seed(request.round, request.client_id)
        return records.RoundChallenge(request.round, seed, pad_seed).to_proto()

    def Commit(  # noqa: N802
        self, request: keyholder_pb2.CommitRequest, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """Client: its signed commitment to its update and the sketches of its ciphertexts."""
        with rpc_errors(context):
            try:
                c = records.UpdateCommitment.from_proto(request)
                require_peer(context, c.update.client_id)
                self.keyholder.commits.commit(c.round, c.update, c.sketches)
            except (FedPSError, ValueError) as exc:
                if self._metrics is not None:
                    self._metrics.commitment_refused(exc)
                raise
        if self._metrics is not None:
            self._metrics.commitment_accepted()
        return common_pb2.Empty()

    def CloseCommits(  # noqa: N802
        self, request: keyholder_pb2.CloseCommitsRequest, context: grpc.ServicerContext
    ) -> keyholder_pb2.CommitSet:
        """Coordinator: the clients committed so far; with freeze, no commitment after."""
        with rpc_errors(context):
            c = records.CommitClosing.from_proto(request)
            ids, frozen = self.keyholder.commits.close(c.round, freeze=c.freeze)
            updates = self.keyholder.commits.updates(c.round) if frozen else []
        excluded = tuple(self.keyholder.commits.excluded)
        return records.CommitSet(tuple(ids), frozen, tuple(updates), excluded).to_proto()

    def GetModelState(  # noqa: N802
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> keyholder_pb2.ModelState:
        """The model's state, the tampering detected and the shards' missed deadlines."""
        return self.keyholder.model_state().to_proto()
