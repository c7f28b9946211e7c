"""Per-client credentials issued at registration, checked on every later coordinator call."""

from __future__ import annotations

import grpc
import pytest

from crypto.enrolment import read_token
from crypto.signing import BlockSigner
from fedps.proto import coordinator_pb2, coordinator_pb2_grpc
from fedps.rpc.transport import create_channel
from tests.conftest import Cluster

pytestmark = pytest.mark.integration


def _token(cluster: Cluster, name: str = "client-0") -> str:
    token = read_token(cluster.config.tls.directory, name)
    assert token is not None
    return token


def _register(stub: coordinator_pb2_grpc.CoordinatorStub, cluster: Cluster) -> tuple[str, bytes]:
    reply = stub.Register(
        coordinator_pb2.RegisterRequest(
            name="probe",
            num_examples=10,
            num_params=cluster.coordinator.layout.num_params,
            signing_key=BlockSigner().public_key,
            enrolment_token=_token(cluster),
        )
    )
    return reply.client_id, reply.credential


@pytest.mark.parametrize("credential", [None, "00" * 32, "not-hex"])
def test_calls_without_the_issued_credential_are_unauthenticated(
    cluster: Cluster, credential: str | None
) -> None:
    # Prepare
    stub = coordinator_pb2_grpc.CoordinatorStub(create_channel(cluster.config.cluster.coordinator))
    client_id, issued = _register(stub, cluster)
    metadata = () if credential is None else (("x-fedps-credential", credential),)
    # Execute
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTask(coordinator_pb2.TaskRequest(client_id=client_id), metadata=metadata)
    # Assert
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = stub.GetTask(
        coordinator_pb2.TaskRequest(client_id=client_id),
        metadata=(("x-fedps-credential", issued.hex()),),
    )
    assert good.kind in (coordinator_pb2.Task.WAIT, coordinator_pb2.Task.TRAIN)


def test_known_id_cannot_be_taken_over(cluster: Cluster) -> None:
    # Prepare
    stub = coordinator_pb2_grpc.CoordinatorStub(create_channel(cluster.config.cluster.coordinator))
    client_id, issued = _register(stub, cluster)
    key = cluster.coordinator.clients[client_id].signing_key

    # Execute: another party names the id with its own key, but holds only another client's
    # token (or none)
    def register(token: str) -> coordinator_pb2.RegisterReply:
        reply: coordinator_pb2.RegisterReply = stub.Register(
            coordinator_pb2.RegisterRequest(
                name="mallory",
                num_examples=10,
                num_params=cluster.coordinator.layout.num_params,
                client_id=client_id,
                signing_key=BlockSigner().public_key,
                enrolment_token=token,
            )
        )
        return reply

    with pytest.raises(grpc.RpcError) as info:
        register("")
    other = register(_token(cluster, "client-1"))

    # Assert: no token is refused; another token registers its own identity, not this one
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert other.client_id == "client-1"
    assert cluster.coordinator.clients[client_id].signing_key == key
    task = stub.GetTask(
        coordinator_pb2.TaskRequest(client_id=client_id),
        metadata=(("x-fedps-credential", issued.hex()),),
    )
    assert task.kind in (coordinator_pb2.Task.WAIT, coordinator_pb2.Task.TRAIN)


def test_report_accepts_an_infinite_epsilon_and_refuses_nan_or_negative(
    cluster: Cluster,
) -> None:
    # Prepare: a registered client (no DP noise gives epsilon = +inf)
    stub = coordinator_pb2_grpc.CoordinatorStub(create_channel(cluster.config.cluster.coordinator))
    client_id, issued = _register(stub, cluster)
    metadata = (("x-fedps-credential", issued.hex()),)

    def report(epsilon: float) -> None:
        request = coordinator_pb2.UpdateReport(client_id=client_id, epsilon=epsilon, delta=1e-5)
        stub.ReportUpdate(request, metadata=metadata)

    # Execute / Assert
    report(float("inf"))
    assert cluster.coordinator.max_epsilon[0] == float("inf")
    for bad in (float("nan"), -1.0):
        with pytest.raises(grpc.RpcError) as info:
            report(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
