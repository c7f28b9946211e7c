"""gRPC face of :class:`server.coordinator.coordinator.Coordinator`.

Under mutual TLS a client's identity is its certificate's common name: ``Register`` passes it
to the coordinator (the client id is that name), and ``GetTask`` and ``ReportUpdate`` must come
from the certificate whose name is the request's client id, on top of the credential issued at
registration. Without TLS the client proves its identity with an enrolment token.
``RemoveShard`` (``fedps shard --remove ID``) and ``JoinShard`` (``fedps shard --join ID``) must
come from the operator's certificate under mutual TLS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from crypto.tls import OPERATOR_NAME
from fedps.errors import ConfigError, InvalidArgumentError, NotReadyError
from fedps.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from fedps.rpc import coordinator_messages as records
from fedps.rpc.coordinator_messages import CREDENTIAL_HEADER
from fedps.rpc.transport import peer_common_name, require_peer, rpc_errors
from server.coordinator.coordinator import Coordinator
from server.coordinator.privacy_ledger import Declaration
from server.coordinator.ring_keeper import RingKeeper

__all__ = ["CREDENTIAL_HEADER", "CoordinatorServicer"]


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin servicer over a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def Register(  # noqa: N802 (gRPC method name)
        self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterReply:
        """Register a client (its identity is its certificate's name under mutual TLS)."""
        c = self.coordinator
        with rpc_errors(context):
            r = records.ClientRegistration.from_proto(request)
            client_id, credential = c.registry.register(
                r.name,
                r.num_examples,
                r.num_params,
                r.signing_key,
                identity=peer_common_name(context),
                enrolment_token=r.enrolment_token,
                epsilon=r.epsilon,
                delta=r.delta,
                declared=Declaration(
                    r.data_source, r.noise_multiplier, r.sample_rate, r.steps_per_round
                ),
            )
        cluster = c.settings.cluster
        return records.RegistrationReply(
            client_id=client_id,
            run_id=c.run_id,
            keyholder=cluster.keyholder,
            shards=dict(zip(cluster.shard_ids, cluster.shards, strict=True)),
            virtual_nodes=cluster.virtual_nodes,
            **(c.desk.ring.view.fields() if c.desk.ring is not None else {}),
            num_params=c.layout.num_params,
            rounds=c.settings.training.rounds,
            credential=credential,
        ).to_proto()

    def GetTask(  # noqa: N802
        self, request: coordinator_pb2.TaskRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.Task:
        """A registered client's next task."""
        with rpc_errors(context):
            query = records.AssignmentQuery.from_proto(request)
            require_peer(context, query.client_id)
            task = self.coordinator.desk.get_task(
                query.client_id,
                _credential(context),
                epsilon=query.epsilon,
                delta=query.delta,
                wait_s=query.wait_s,
                committed_round=query.committed_round,
            )
        return task.to_proto()

    def ReportUpdate(  # noqa: N802
        self, request: coordinator_pb2.UpdateReport, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """A registered client's report of a round."""
        with rpc_errors(context):
            report = records.UpdateReport.from_proto(request)
            require_peer(context, report.client_id)
            self.coordinator.desk.report(
                report.client_id,
                report.round,
                epsilon=report.epsilon,
                delta=report.delta,
                bytes_pushed=report.bytes_pushed,
                budget_exhausted=report.budget_exhausted,
                credential=_credential(context),
                noise_multiplier=report.noise_multiplier,
                metrics=report.metrics,
                phase_seconds=report.phase_seconds,
            )
        return common_pb2.Empty()

    def GetStatus(  # noqa: N802
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> coordinator_pb2.ClusterStatus:
        """The run's status, for the operator."""
        c = self.coordinator
        epsilon, delta = c.max_epsilon
        return records.ClusterStatus(
            noise=c.settings.privacy.noise_mode,
            run_id=c.run_id,
            round=c.recorded_round,  # with its record in the history
            version=c.version,
            registered=len(c.clients),
            finished=c.finished,
            history=tuple(records.RoundSummary.of(r) for r in list(c.history)),
            max_epsilon=epsilon,
            delta=delta,
            bytes_pushed=c.bytes_pushed,
            last_checkpoint_unix=c.last_checkpoint,
            client_epsilons=c.client_epsilons,
            client_noise_multipliers=c.client_noise_multipliers,
            client_rounds=c.registry.client_rounds,
            shard_misses=c.shard_misses.totals(),
            stalled=tuple(c.shard_misses.stalled),
            told_done=len(c.desk.told_done),
            client_reported_epsilons=c.registry.reported_epsilons,
            privacy_warnings=tuple(c.registry.warnings),
            spent_clients=tuple(c.registry.spent_clients()),
            flagged_clients=tuple(c.registry.flagged_clients()),
            **_ring_status(c.desk.ring),
        ).to_proto()

    def RemoveShard(  # noqa: N802
        self, request: coordinator_pb2.RemoveShardRequest, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """Operator: remove a shard from the ring for good (its blocks move along the ring)."""
        return self._change_ring(context, lambda ring: ring.remove(request.shard_id))

    def JoinShard(  # noqa: N802
        self, request: coordinator_pb2.JoinShardRequest, context: grpc.ServicerContext
    ) -> common_pb2.Empty:
        """Operator: add an empty shard to the ring at the next round (blocks move to it)."""
        return self._change_ring(context, lambda ring: ring.join(request.shard_id))

    def _change_ring(
        self, context: grpc.ServicerContext, change: Callable[[RingKeeper], object]
    ) -> common_pb2.Empty:
        """The operator's ``change`` of the ring (a bad shard name: ``INVALID_ARGUMENT``)."""
        with rpc_errors(context):
            require_peer(context, OPERATOR_NAME)
            ring = self.coordinator.desk.ring
            if ring is None:
                raise NotReadyError("the coordinator keeps no ring yet")
            try:
                change(ring)
            except ConfigError as exc:
                raise InvalidArgumentError(str(exc)) from exc
        return common_pb2.Empty()

    def GetClosedRound(  # noqa: N802
        self, request: coordinator_pb2.ClosedRoundRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ClosedRound:
        """Key-holder party: the clients a round closed with (once sent to the key holder).

        With the shard ring the coordinator applies it on: the party fetches the sums from it.
        """
        with rpc_errors(context):
            closed = self.coordinator.closed.get(request.round)
            ring = self.coordinator.desk.ring
            view = ring.view.fields() if ring is not None else {}
        return records.ClosedRound(request.round, tuple(sorted(closed)), **view).to_proto()


def _ring_status(ring: RingKeeper | None) -> dict[str, Any]:
    """The ring's fields of the status (none before a ring is kept)."""
    if ring is None:
        return {}
    view = ring.view
    return {
        "ring_version": view.version,
        "ring_nodes": view.nodes,
        "ring_moves": ring.status_lines(),
    }


def _credential(context: grpc.ServicerContext) -> bytes:
    """The ``x-fedps-credential`` metadata of a call (hex), as bytes."""
    for key, value in context.invocation_metadata():
        if key == CREDENTIAL_HEADER:
            try:
                return bytes.fromhex(value if isinstance(value, str) else value.decode())
            except ValueError:
                return b""
    return b""
