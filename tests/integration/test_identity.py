"""One identity per client, and no RPC for a caller without a certificate of the cluster.

Issue 14's acceptance (d) and (e), against real servers on loopback, in sync and async mode:

(d) A second registration with the same certificate (mutual TLS) or the same enrolment token
    (``--insecure``) returns the same client id, and a registration with neither is refused.
    The id is the identity, so a client with one certificate or token cannot register a
    second id (the Sybils of issue 14, item 5), and under mutual TLS a certificate may act
    only for its own client id (``GetTask``, ``ReportUpdate``, ``PushBlocks``).
(e) In the default configuration (mutual TLS, certificates made on first start as
    ``fedps up`` does) a caller without a certificate of the cluster completes no RPC of the
    ``Shard``, ``KeyHolder`` and ``Coordinator`` services: neither over plaintext, nor over TLS
    without a client certificate, nor with a certificate from another CA.

Mutual TLS is process-wide, so the default-configuration cluster runs as separate processes
(``fedps.runtime.deployment.Deployment``, as ``fedps up`` starts it); this test process calls it
through channels that carry one identity each. The token tests use the in-process harness,
which runs without TLS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from crypto.enrolment import issue_token, read_token
from crypto.signing import BlockSigner
from crypto.tls import (
    OPERATOR_NAME,
    TlsIdentity,
    issue_certificate,
    make_ca,
)
from fedps.config import FedPSConfig, load_config
from fedps.learning.tasks import load_task
from fedps.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    keyholder_pb2,
    shard_pb2,
    shard_pb2_grpc,
)
from fedps.provisioning import provision_cluster
from fedps.rpc.transport import channel_credentials
from fedps.runtime.deployment import Deployment, local_cluster, write_config
from server.coordinator.evaluator import Evaluator
from tests.conftest import Cluster, start_cluster
from tests.process_cluster import start_servers

pytestmark = [pytest.mark.attack, pytest.mark.integration]

MODES = ["sync", "async"]
_TIMEOUT_S = 10.0
_CREDENTIAL = "x-fedps-credential"
# Refusals of a caller without a certificate of the cluster: the TLS handshake (UNAVAILABLE),
# or the servers' own check on a connection that got through (UNAUTHENTICATED).
_NO_ENTRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED}


def _training(mode: str) -> dict[str, object]:
    # Three identities, long grace: no round opens while the tests register one or two.
    return {"mode": mode, "clients": 3, "min_quorum": 2, "rounds": 2, "deadline_s": 600.0}


def _request(
    num_params: int, *, token: str = "", key: bytes | None = None
) -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(
        name="probe",
        num_examples=10,
        num_params=num_params,
        signing_key=key or BlockSigner().public_key,
        enrolment_token=token,
    )


def _code(fn: Callable[[], object]) -> grpc.StatusCode:
    """The status code of a call (OK if it succeeded)."""
    try:
        fn()
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code()
    return grpc.StatusCode.OK


# ---------------------------------------------------------------- without TLS: tokens (d)


@pytest.fixture(params=MODES)
def token_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """An in-process cluster without TLS (explicitly), tokens for client-0..2 in its
    ``tls.directory``."""
    cluster = start_cluster(tmp_path, training=_training(str(request.param)))
    yield cluster
    cluster.stop()


def _token(cluster: Cluster, name: str) -> str:
    token = read_token(cluster.config.tls.directory, name)
    assert token is not None
    return token


def test_same_token_registers_the_same_id_again(token_cluster: Cluster) -> None:
    # Prepare
    coordinator = token_cluster.coordinator
    stub = coordinator_pb2_grpc.CoordinatorStub(
        grpc.insecure_channel(token_cluster.config.cluster.coordinator)
    )
    num_params = coordinator.layout.num_params
    token = _token(token_cluster, "client-0")
    restarted = BlockSigner()

    # Execute: the client registers, then registers again with a new key (a restart)
    first = stub.Register(_request(num_params, token=token), timeout=_TIMEOUT_S)
    second = stub.Register(
        _request(num_params, token=token, key=restarted.public_key), timeout=_TIMEOUT_S
    )

    # Assert: one id, the identity's; a new credential and key replace the old ones
    assert first.client_id == second.client_id == "client-0"
    assert list(coordinator.clients) == ["client-0"]
    assert coordinator.clients["client-0"].signing_key == restarted.public_key.hex()
    assert first.credential and second.credential and first.credential != second.credential

    def task(credential: bytes) -> grpc.StatusCode:
        request = coordinator_pb2.TaskRequest(client_id="client-0")
        metadata = ((_CREDENTIAL, credential.hex()),)
        return _code(lambda: stub.GetTask(request, metadata=metadata, timeout=_TIMEOUT_S))

    assert task(second.credential) == grpc.StatusCode.OK
    assert task(first.credential) == grpc.StatusCode.UNAUTHENTICATED


def test_registration_without_a_valid_token_is_refused(token_cluster: Cluster) -> None:
    # Prepare: no token, and tokens nobody provisioned (another deployment's key, another
    # identity's MAC, a made-up name, case and whitespace changes)
    coordinator = token_cluster.coordinator
    stub = coordinator_pb2_grpc.CoordinatorStub(
        grpc.insecure_channel(token_cluster.config.cluster.coordinator)
    )
    valid = _token(token_cluster, "client-0")
    name, _, mac = valid.rpartition(".")
    other_mac = _token(token_cluster, "client-1").rpartition(".")[2]
    forged = [
        "",
        issue_token(b"\x01" * 32, "client-0"),
        f"{name}.{other_mac}",
        f"client-3.{mac}",
        f"mallory.{'0' * 64}",
        f"{name}.{mac.upper()}",
        f" {valid}",
        name,
    ]

    def register(token: str) -> grpc.StatusCode:
        request = _request(coordinator.layout.num_params, token=token)
        return _code(lambda: stub.Register(request, timeout=_TIMEOUT_S))

    # Execute
    codes = [register(token) for token in forged]

    # Assert: every one refused as unauthenticated; nobody was registered
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(forged)
    assert coordinator.clients == {}


def test_identities_are_exactly_the_provisioned_tokens(token_cluster: Cluster) -> None:
    # Prepare: one client holding every provisioned token registers with each, twice
    coordinator = token_cluster.coordinator
    stub = coordinator_pb2_grpc.CoordinatorStub(
        grpc.insecure_channel(token_cluster.config.cluster.coordinator)
    )
    names = [f"client-{i}" for i in range(token_cluster.config.training.clients)]

    # Execute
    ids = [
        stub.Register(
            _request(coordinator.layout.num_params, token=_token(token_cluster, name)),
            timeout=_TIMEOUT_S,
        ).client_id
        for name in names * 2
    ]

    # Assert: as many ids as identities the operator provisioned, never more
    assert ids == names * 2
    assert sorted(coordinator.clients) == names


# ---------------------------------------------------------------- the default: mutual TLS


@dataclass
class TlsCluster:
    """Key holder, shards and coordinator as processes in the default configuration."""

    config: FedPSConfig
    certs: Path
    stranger: TlsIdentity  # a client certificate from another CA (trusting ours)
    num_params: int

    def identity(self, name: str) -> TlsIdentity:
        return TlsIdentity.load(self.certs, name)

    @property
    def no_certificate(self) -> TlsIdentity:
        """Trusts the deployment's CA (its certificate is public) but has no certificate."""
        return TlsIdentity(ca_cert=self.identity(OPERATOR_NAME).ca_cert, cert=b"", key=b"")

    def channel(self, address: str, identity: TlsIdentity | None) -> grpc.Channel:
        """A channel that presents ``identity`` (``None``: plaintext)."""
        if identity is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, channel_credentials(identity))

    def coordinator(self, identity: TlsIdentity | None) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(
            self.channel(self.config.cluster.coordinator, identity)
        )

    def registered(self) -> int:
        stub = self.coordinator(self.identity(OPERATOR_NAME))
        status = stub.GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S)
        return int(status.registered)


def _start_tls_cluster(root: Path, mode: str) -> tuple[TlsCluster, Deployment]:
    """The default configuration but for addresses and directories; the certificates are
    made on first start, as ``fedps up`` makes them."""
    config = load_config(
        None,
        cluster=local_cluster(root / "state"),
        training=_training(mode),
        tls={"directory": str(root / "certs")},
    )
    assert config.tls.enabled and not config.tls.insecure  # the default
    provision_cluster(config)
    make_ca(root / "other-ca")
    issue_certificate(root / "other-ca", "client-0", hosts=[], client=True, server=False)
    foreign = TlsIdentity.load(root / "other-ca", "client-0")
    ours = TlsIdentity.load(root / "certs", "client-0")
    path = root / "fedps.toml"
    write_config(config, path)
    deployment = Deployment(path, config)
    cluster = TlsCluster(
        config=config,
        certs=root / "certs",
        stranger=TlsIdentity(ca_cert=ours.ca_cert, cert=foreign.cert, key=foreign.key),
        num_params=Evaluator(load_task(config), seed=config.training.seed).initial_vector().size,
    )
    try:
        start_servers(deployment)
    except BaseException:
        deployment.stop()
        raise
    return cluster, deployment


@pytest.fixture
def tls_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TlsCluster]:
    """Key holder, shards and coordinator as processes, default configuration, in the mode
    the test is parametrised with (``indirect``; sync otherwise)."""
    mode = str(getattr(request, "param", "sync"))
    cluster, deployment = _start_tls_cluster(tmp_path, mode)
    yield cluster
    deployment.stop()


def _check_same_certificate_same_id(cluster: TlsCluster) -> None:
    """client-0 registers, then again with a new key (a restarted client): the certificate's
    name both times, no second id, and the old credential no longer works."""
    stub = cluster.coordinator(cluster.identity("client-0"))
    first = stub.Register(_request(cluster.num_params), timeout=_TIMEOUT_S)
    registered = cluster.registered()
    second = stub.Register(_request(cluster.num_params), timeout=_TIMEOUT_S)
    assert first.client_id == second.client_id == "client-0"
    assert cluster.registered() == registered
    request = coordinator_pb2.TaskRequest(client_id="client-0")
    old = ((_CREDENTIAL, first.credential.hex()),)
    new = ((_CREDENTIAL, second.credential.hex()),)
    assert _code(lambda: stub.GetTask(request, metadata=new, timeout=_TIMEOUT_S)) == (
        grpc.StatusCode.OK
    )
    assert _code(lambda: stub.GetTask(request, metadata=old, timeout=_TIMEOUT_S)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )


def _check_token_is_no_certificate(cluster: TlsCluster) -> None:
    """client-1's token, sent by the holder of client-0's certificate: under mutual TLS the
    certificate is the identity."""
    token = read_token(cluster.certs, "client-1")
    assert token is not None
    stub = cluster.coordinator(cluster.identity("client-0"))
    reply = stub.Register(_request(cluster.num_params, token=token), timeout=_TIMEOUT_S)
    assert reply.client_id == "client-0"


def _check_no_registration_without_client_certificate(cluster: TlsCluster) -> None:
    """No certificate, one of another CA, or the operator's (of the cluster, not a client):
    refused, even with a client's token (the deployment's CA certificate is public)."""
    token = read_token(cluster.certs, "client-1") or ""
    before = cluster.registered()
    callers = {
        "plaintext": None,
        "no certificate": cluster.no_certificate,
        "other CA": cluster.stranger,
        "operator": cluster.identity(OPERATOR_NAME),
    }
    request = _request(cluster.num_params, token=token)
    codes = {}
    for caller, identity in callers.items():
        stub = cluster.coordinator(identity)
        codes[caller] = _code(lambda: stub.Register(request, timeout=_TIMEOUT_S))  # noqa: B023
    operator = codes.pop("operator")
    assert operator == grpc.StatusCode.PERMISSION_DENIED
    assert set(codes.values()) <= _NO_ENTRY, codes
    assert cluster.registered() == before


def _check_certificate_acts_for_its_own_id(cluster: TlsCluster) -> None:
    """client-1, a valid client of the cluster that knows client-0's id and even its
    credential, cannot get its task, report for it or push as it."""
    victim = cluster.coordinator(cluster.identity("client-0"))
    credential = victim.Register(_request(cluster.num_params), timeout=_TIMEOUT_S).credential
    metadata = ((_CREDENTIAL, credential.hex()),)
    client_1 = cluster.identity("client-1")
    mallory = cluster.coordinator(client_1)
    shard = shard_pb2_grpc.ShardStub(cluster.channel(cluster.config.cluster.shards[0], client_1))
    task = coordinator_pb2.TaskRequest(client_id="client-0")
    report = coordinator_pb2.UpdateReport(client_id="client-0", round=1, epsilon=1.0)
    push = shard_pb2.PushRequest(client_id="client-0", round=1)
    codes = [
        _code(lambda: mallory.GetTask(task, metadata=metadata, timeout=_TIMEOUT_S)),
        _code(lambda: mallory.ReportUpdate(report, metadata=metadata, timeout=_TIMEOUT_S)),
        _code(lambda: shard.PushBlocks(iter([push]), timeout=_TIMEOUT_S)),
    ]
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 3
    reply = victim.GetTask(task, metadata=metadata, timeout=_TIMEOUT_S)
    assert reply.kind in (coordinator_pb2.Task.WAIT, coordinator_pb2.Task.TRAIN)


def _every_rpc() -> list[tuple[ServiceDescriptor, MethodDescriptor]]:
    services = [
        shard_pb2.DESCRIPTOR.services_by_name["Shard"],
        keyholder_pb2.DESCRIPTOR.services_by_name["KeyHolder"],
        coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
    ]
    return [(service, method) for service in services for method in service.methods]


def _call_rpc(
    channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor
) -> grpc.StatusCode:
    """Call ``method`` with an empty request (once, for a stream); its status code."""
    path = f"/{service.full_name}/{method.name}"
    request = message_factory.GetMessageClass(method.input_type)()
    kwargs: dict[str, Callable[..., bytes]] = {
        "request_serializer": lambda m: m.SerializeToString(),
        "response_deserializer": lambda b: b,
    }
    if method.client_streaming and method.server_streaming:
        stream_stream = channel.stream_stream(path, **kwargs)
        return _code(lambda: list(stream_stream(iter([request]), timeout=_TIMEOUT_S)))
    if method.client_streaming:
        stream_unary = channel.stream_unary(path, **kwargs)
        return _code(lambda: stream_unary(iter([request]), timeout=_TIMEOUT_S))
    if method.server_streaming:
        unary_stream = channel.unary_stream(path, **kwargs)
        return _code(lambda: list(unary_stream(request, timeout=_TIMEOUT_S)))
    unary_unary = channel.unary_unary(path, **kwargs)
    return _code(lambda: unary_unary(request, timeout=_TIMEOUT_S))


def _check_no_rpc_without_a_certificate(tls_cluster: TlsCluster) -> None:
    """(e): every RPC of the three services, at the role that serves it, called by callers
    without a certificate of the cluster: not one completes, nobody is registered, and the
    servers still answer the operator."""
    cluster = tls_cluster.config.cluster
    address = {"Shard": cluster.shards[0], "KeyHolder": cluster.keyholder}
    callers = {
        "plaintext": None,
        "no certificate": tls_cluster.no_certificate,
        "other CA": tls_cluster.stranger,
    }
    rpcs = _every_rpc()
    codes = {}
    for caller, identity in callers.items():
        for service, method in rpcs:
            target = address.get(service.name, cluster.coordinator)
            with tls_cluster.channel(target, identity) as channel:
                code = _call_rpc(channel, service, method)
            codes[f"{caller}: {service.name}.{method.name}"] = code
    assert len(codes) == len(callers) * len(rpcs) >= 3 * 18  # 18 RPCs when this was written
    assert {name: code for name, code in codes.items() if code not in _NO_ENTRY} == {}
    assert tls_cluster.registered() == 0


def _check_status_answers_only_the_operator(tls_cluster: TlsCluster) -> None:
    """The coordinator's and a shard's status: for the operator's certificate, refused to
    the valid certificates of every other role, but a shard's to the coordinator's (it asks
    every shard on the ring before a round opens)."""
    cluster = tls_cluster.config.cluster
    roles = ["client-0", "coordinator", "keyholder", "shard-1", OPERATOR_NAME]
    codes: dict[str, tuple[grpc.StatusCode, grpc.StatusCode]] = {}
    for role in roles:
        identity = tls_cluster.identity(role)
        coordinator = tls_cluster.coordinator(identity)
        shard = shard_pb2_grpc.ShardStub(tls_cluster.channel(cluster.shards[0], identity))
        codes[role] = (
            _code(lambda: coordinator.GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S)),  # noqa: B023
            _code(lambda: shard.GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S)),  # noqa: B023
        )
    assert codes.pop(OPERATOR_NAME) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert codes.pop("coordinator") == (denied, grpc.StatusCode.OK)
    assert set(codes.values()) == {(denied, denied)}


@pytest.mark.parametrize("tls_cluster", MODES, indirect=True)
def test_default_configuration_admits_only_the_clusters_certificates(
    tls_cluster: TlsCluster,
) -> None:
    # Prepare: the cluster in the default configuration (mutual TLS), in sync or async mode,
    # one for every check (each start is four role processes)
    # Execute / Assert: each check calls and asserts against the live cluster; (e) first,
    # while nobody is registered
    _check_no_rpc_without_a_certificate(tls_cluster)
    _check_status_answers_only_the_operator(tls_cluster)
    # (d): one certificate is one client id
    _check_same_certificate_same_id(tls_cluster)
    _check_token_is_no_certificate(tls_cluster)
    _check_no_registration_without_client_certificate(tls_cluster)
    _check_certificate_acts_for_its_own_id(tls_cluster)
    assert tls_cluster.registered() == 1  # client-0, however often it registered
