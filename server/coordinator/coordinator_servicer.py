"""gRPC face of :class:`server.coordinator.coordinator.Coordinator`.

Under mutual TLS a client's identity is its certificate's common name: ``Register`` passes it
to the coordinator (the client id is that name), and ``GetTask`` and ``ReportUpdate`` must come
from the certificate whose name is the request's client id, on top of the credential issued at
registration. Without TLS the client proves its identity with an enrolment token.
"""

from __future__ import annotations

import grpc

from fedps.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from fedps.transport import peer_common_name, require_peer, rpc_errors
from server.coordinator.coordinator import Coordinator

__all__ = ["CREDENTIAL_HEADER", "CoordinatorServicer"]

#: Metadata key carrying a client's credential (hex).
CREDENTIAL_HEADER = "x-fedps-credential"

_KINDS = {
    "wait": coordinator_pb2.Task.WAIT,
    "train": coordinator_pb2.Task.TRAIN,
    "done": coordinator_pb2.Task.DONE,
    "push": coordinator_pb2.Task.PUSH,
}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin servicer over a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def Register(  # noqa: N802 (gRPC method name)
        self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterReply:
        c = self.coordinator
        with rpc_errors(context):
            client_id, credential = c.registry.register(
                request.name,
                request.num_examples,
                request.num_params,
                request.signing_key,
                identity=peer_common_name(context),
                enrolment_token=request.enrolment_token,
                epsilon=request.epsilon,
                delta=request.delta,
            )
        cluster = c.config.cluster
        return coordinator_pb2.RegisterReply(
            client_id=client_id,
            run_id=c.run_id,
            keyholder=cluster.keyholder,
            shards=[
                coordinator_pb2.ShardAddress(shard_id=sid, address=addr)
                for sid, addr in zip(cluster.shard_ids, cluster.shards, strict=True)
            ],
            virtual_nodes=cluster.virtual_nodes,
            num_params=c.layout.num_params,
            rounds=c.config.training.rounds,
            credential=credential,
        )

    def GetTask(  # noqa: N802
        self, request: coordinator_pb2.TaskRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.Task:
        with rpc_errors(context):
            require_peer(context, request.client_id)
            task = self.coordinator.get_task(
                request.client_id,
                _credential(context),
                epsilon=request.epsilon,
                delta=request.delta,
            )
        return coordinator_pb2.Task(
            kind=_KINDS[task.kind],
            round=task.round,
            version=task.version,
            deadline_unix=task.deadline_unix,
            retry_after=task.retry_after,
            weight_scale=task.weight_scale,
            context_id=task.context_id,
        )

    def ReportUpdate(  # noqa: N802
        self, request: coordinator_pb2.UpdateReport, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        with rpc_errors(context):
            require_peer(context, request.client_id)
            self.coordinator.report(
                request.client_id,
                request.round,
                epsilon=request.epsilon,
                delta=request.delta,
                bytes_pushed=request.bytes_pushed,
                budget_exhausted=request.budget_exhausted,
                credential=_credential(context),
                noise_multiplier=request.noise_multiplier,
            )
        return common_pb2.Empty()

    def GetStatus(  # noqa: N802
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> coordinator_pb2.ClusterStatus:
        c = self.coordinator
        epsilon, delta = c.max_epsilon
        return coordinator_pb2.ClusterStatus(
            noise=c.config.privacy.noise_mode,
            run_id=c.run_id,
            round=c.round,
            version=c.version,
            registered=len(c.clients),
            finished=c.finished,
            history=[
                coordinator_pb2.RoundSummary(
                    round=r.round,
                    version=r.version,
                    contributors=r.contributors,
                    accuracy=r.accuracy,
                    loss=r.loss,
                    max_epsilon=r.max_epsilon,
                    bytes_pushed=r.bytes_pushed,
                    seconds=r.seconds,
                    abandoned=r.abandoned,
                    push_seconds=r.push_seconds,
                )
                for r in list(c.history)
            ],
            max_epsilon=epsilon,
            delta=delta,
            bytes_pushed=c.bytes_pushed,
            last_checkpoint_unix=c.last_checkpoint,
            client_epsilons=c.client_epsilons,
            client_noise_multipliers=c.client_noise_multipliers,
        )


def _credential(context: grpc.ServicerContext) -> bytes:
    """The ``x-fedps-credential`` metadata of a call (hex), as bytes."""
    for key, value in context.invocation_metadata():
        if key == CREDENTIAL_HEADER:
            try:
                return bytes.fromhex(value if isinstance(value, str) else value.decode())
            except ValueError:
                return b""
    return b""
