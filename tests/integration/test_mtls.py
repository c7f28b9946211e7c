"""Mutual TLS on real gRPC servers on loopback: who gets in, who does not, and with which code.

A shard is served from ``create_server()`` + ``bind()`` after ``configure_tls``, exactly as
``serve_forever`` does. Clients that fail must not disturb it: after each refusal a valid
client still gets an answer.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from crypto.tls import (
    OPERATOR_NAME,
    TlsIdentity,
    configure_tls,
    issue_certificate,
    make_ca,
    tls_identity,
)
from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.proto import common_pb2, shard_pb2, shard_pb2_grpc
from fedps.provisioning import reset_tls, setup_tls
from fedps.rpc.transport import (
    bind,
    call,
    channel_credentials,
    create_channel,
    create_server,
)
from server.serve import add_shard

pytestmark = pytest.mark.integration

_TIMEOUT_S = 5.0


@dataclass
class Pki:
    """A deployment's CA with a server and a client identity, and a stranger's CA."""

    directory: Path
    server: TlsIdentity
    client: TlsIdentity
    coordinator: TlsIdentity
    operator: TlsIdentity
    no_cert: TlsIdentity  # trusts the CA but has no certificate of its own (cert/key empty)
    foreign_client: TlsIdentity  # signed by another CA, trusts ours
    foreign_ca: bytes  # the other CA's certificate


@dataclass
class TlsShard:
    address: str
    pki: Pki
    server: grpc.Server
    plaintext_address: str  # a plaintext port on the same server: only the interceptor guards it


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ours, theirs = root / "ours", root / "theirs"
    make_ca(ours)
    make_ca(theirs)
    issue_certificate(ours, "shard-0", hosts=[], client=True, server=True)
    issue_certificate(ours, "client-0", hosts=[], client=True, server=False)
    issue_certificate(ours, "coordinator", hosts=[], client=True, server=True)
    issue_certificate(ours, OPERATOR_NAME, hosts=[], client=True, server=False)
    issue_certificate(theirs, "client-0", hosts=[], client=True, server=False)
    client = TlsIdentity.load(ours, "client-0")
    stranger = TlsIdentity.load(theirs, "client-0")
    return Pki(
        directory=ours,
        server=TlsIdentity.load(ours, "shard-0"),
        client=client,
        coordinator=TlsIdentity.load(ours, "coordinator"),
        operator=TlsIdentity.load(ours, OPERATOR_NAME),
        no_cert=TlsIdentity(ca_cert=client.ca_cert, cert=b"", key=b""),
        foreign_client=TlsIdentity(ca_cert=client.ca_cert, cert=stranger.cert, key=stranger.key),
        foreign_ca=stranger.ca_cert,
    )


@pytest.fixture
def tls_shard(pki: Pki) -> Iterator[TlsShard]:
    configure_tls(pki.server)
    server = create_server()
    try:
        port = bind(server, "127.0.0.1:0")
        plaintext_port = server.add_insecure_port("127.0.0.1:0")
        config = load_config(
            None,
            cluster={"keyholder": "127.0.0.1:1", "shards": [f"127.0.0.1:{port}"]},
            tls={"directory": str(pki.directory)},  # mutual TLS: the default
        )
        add_shard(server, config, 0)
        server.start()
        yield TlsShard(f"127.0.0.1:{port}", pki, server, f"127.0.0.1:{plaintext_port}")
    finally:
        server.stop(grace=None)
        reset_tls()


def _status_code(channel: grpc.Channel) -> grpc.StatusCode:
    """Call Shard.GetStatus; the status code of the failure (OK if it succeeded)."""
    try:
        shard_pb2_grpc.ShardStub(channel).GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code()
    return grpc.StatusCode.OK


def _assert_still_serving(shard: TlsShard) -> None:
    with grpc.secure_channel(shard.address, channel_credentials(shard.pki.operator)) as channel:
        reply = shard_pb2_grpc.ShardStub(channel).GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S)
    assert reply.shard_id == "shard-0"


def test_valid_certificate_is_served(tls_shard: TlsShard) -> None:
    # Prepare: this process speaks as the operator from now on (the server's port is bound).
    configure_tls(tls_shard.pki.operator)

    # Execute: through fedps's own channel factory, to 127.0.0.1 (verified by SAN IP).
    channel = create_channel(tls_shard.address)
    stub = shard_pb2_grpc.ShardStub(channel)
    reply = call(lambda: stub.GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S), "status")
    channel.close()

    # Assert
    assert reply.shard_id == "shard-0"


def test_localhost_name_verifies_too(tls_shard: TlsShard) -> None:
    address = tls_shard.address.replace("127.0.0.1", "localhost")
    with grpc.secure_channel(address, channel_credentials(tls_shard.pki.operator)) as channel:
        assert _status_code(channel) == grpc.StatusCode.OK


@pytest.mark.parametrize("caller", ["client", "coordinator", "server"])
def test_status_answers_only_the_operator(tls_shard: TlsShard, caller: str) -> None:
    """A shard's status: the operator's, and the coordinator's (it asks every shard on the ring
    before a round opens); any other role of the deployment is refused."""
    # Prepare: a valid certificate of the deployment, of another role than operator
    identity: TlsIdentity = getattr(tls_shard.pki, caller)

    # Execute
    with grpc.secure_channel(tls_shard.address, channel_credentials(identity)) as channel:
        code = _status_code(channel)

    # Assert
    allowed = caller == "coordinator"
    assert code == (grpc.StatusCode.OK if allowed else grpc.StatusCode.PERMISSION_DENIED)
    _assert_still_serving(tls_shard)


def test_missing_client_certificate_is_refused(tls_shard: TlsShard) -> None:
    # Execute
    with grpc.secure_channel(
        tls_shard.address, channel_credentials(tls_shard.pki.no_cert)
    ) as channel:
        code = _status_code(channel)

    # Assert: the TLS handshake refuses the peer, which gRPC reports as UNAVAILABLE; the
    # server never runs the method. (UNAUTHENTICATED is what the interceptor answers on a
    # connection that got through without a certificate; see the plaintext-port test.)
    assert code == grpc.StatusCode.UNAVAILABLE
    _assert_still_serving(tls_shard)


def test_certificate_from_another_ca_is_refused(tls_shard: TlsShard) -> None:
    creds = channel_credentials(tls_shard.pki.foreign_client)
    with grpc.secure_channel(tls_shard.address, creds) as channel:
        code = _status_code(channel)

    assert code == grpc.StatusCode.UNAVAILABLE  # refused in the handshake, like no certificate
    _assert_still_serving(tls_shard)


def test_server_from_another_ca_is_not_trusted(tls_shard: TlsShard, pki: Pki) -> None:
    # The client trusts only the other CA: it must refuse our server's certificate.
    stranger = TlsIdentity(ca_cert=pki.foreign_ca, cert=pki.client.cert, key=pki.client.key)
    with grpc.secure_channel(tls_shard.address, channel_credentials(stranger)) as channel:
        code = _status_code(channel)

    assert code == grpc.StatusCode.UNAVAILABLE
    _assert_still_serving(tls_shard)


def test_plaintext_client_on_tls_port_is_refused(tls_shard: TlsShard) -> None:
    with grpc.insecure_channel(tls_shard.address) as channel:
        code = _status_code(channel)

    assert code == grpc.StatusCode.UNAVAILABLE
    _assert_still_serving(tls_shard)


def test_unauthenticated_peer_is_refused_by_the_interceptor(tls_shard: TlsShard) -> None:
    # A port opened behind fedps's back (plaintext) on a TLS-configured server: the handshake
    # cannot refuse the peer, so the server-side check answers UNAUTHENTICATED.
    with grpc.insecure_channel(tls_shard.plaintext_address) as channel:
        code = _status_code(channel)

    assert code == grpc.StatusCode.UNAUTHENTICATED
    _assert_still_serving(tls_shard)


def test_setup_tls_loads_the_role_identity(pki: Pki) -> None:
    # Prepare: the default configuration (mutual TLS) and one that only confirms it
    default = load_config(None, tls={"directory": str(pki.directory)})
    confirmed = load_config(None, tls={"enabled": True, "directory": str(pki.directory)})
    try:
        # Execute / Assert
        setup_tls(default.tls, "shard-0")
        assert tls_identity() == pki.server
        setup_tls(confirmed.tls, "coordinator")
        assert tls_identity() == pki.coordinator
    finally:
        reset_tls()


def test_setup_tls_missing_identity_is_a_clear_error(pki: Pki) -> None:
    config = load_config(None, tls={"directory": str(pki.directory)})
    try:
        with pytest.raises(ConfigError, match=r"keyholder\.crt.*fedps certs"):
            setup_tls(config.tls, "keyholder")
        assert tls_identity() is None
    finally:
        reset_tls()


def test_insecure_is_plaintext_and_warns(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: an identity configured before (as after a TLS run in the same process)
    insecure = load_config(None, tls={"insecure": True}).tls
    configure_tls(pki.server)
    try:
        # Execute: the CLI and serve_forever both set up the same process
        with caplog.at_level(logging.WARNING, logger="fedps"):
            setup_tls(insecure, "keyholder")
            setup_tls(insecure, "keyholder")
        # Assert: plaintext from now on, said once per process however it was asked for
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        message = warnings[0].getMessage()
        assert "unencrypted and unauthenticated" in message
        assert "--insecure" in message and "enrolment token" in message
        assert tls_identity() is None
    finally:
        reset_tls()


def _open_round_code(shard: TlsShard, identity: TlsIdentity) -> grpc.StatusCode:
    """Call Shard.OpenRound (round 1) as ``identity``; the status code (OK if it succeeded)."""
    request = shard_pb2.OpenRoundRequest(round=1)
    with grpc.secure_channel(shard.address, channel_credentials(identity)) as channel:
        try:
            shard_pb2_grpc.ShardStub(channel).OpenRound(request, timeout=_TIMEOUT_S)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code()
    return grpc.StatusCode.OK


def test_a_role_rpc_is_refused_to_a_certificate_of_another_role(tls_shard: TlsShard) -> None:
    # Execute: a client's certificate (valid, from the deployment's CA) tries to open a round
    code = _open_round_code(tls_shard, tls_shard.pki.client)

    # Assert: refused by role; the shard still serves, and the coordinator's certificate
    # gets past the role check (whatever the shard then says about the request itself)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    _assert_still_serving(tls_shard)
    assert _open_round_code(tls_shard, tls_shard.pki.coordinator) not in (
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAVAILABLE,
    )


def _status_call(address: str, identity: TlsIdentity, **options: str) -> None:
    """Shard.GetStatus through :func:`call`, as every fedps caller makes it."""
    creds = channel_credentials(identity)
    with grpc.secure_channel(address, creds, options=list(options.items())) as channel:
        stub = shard_pb2_grpc.ShardStub(channel)
        call(lambda: stub.GetStatus(common_pb2.Empty(), timeout=_TIMEOUT_S), "shard status")


def test_a_server_from_another_ca_is_a_configuration_error_naming_the_ca_file(
    tls_shard: TlsShard, pki: Pki, tmp_path: Path
) -> None:
    # Prepare: this party trusts another CA (read from a file, as `fedps certs` writes it)
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(pki.foreign_ca)
    stranger = TlsIdentity(pki.foreign_ca, pki.client.cert, pki.client.key, ca_path=str(ca_file))
    configure_tls(stranger)
    try:
        # Execute / Assert: not a peer's transient failure, but this party's configuration
        with pytest.raises(ConfigError, match="not issued by the CA this party trusts") as caught:
            _status_call(tls_shard.address, stranger)
    finally:
        configure_tls(None)
    assert str(ca_file) in str(caught.value)
    assert caught.value.__cause__ is None  # so a client takes it as its own fault and stops
    _assert_still_serving(tls_shard)


def test_a_server_certificate_for_another_name_is_a_configuration_error(
    tls_shard: TlsShard, pki: Pki
) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="does not name the address dialled"):
        _status_call(
            tls_shard.address, pki.client, **{"grpc.ssl_target_name_override": "elsewhere"}
        )
    _assert_still_serving(tls_shard)


def _run_client(config: Path) -> subprocess.CompletedProcess[str]:
    """``fedps client --config CONFIG`` as a process (a hang guard of 120 s)."""
    return subprocess.run(
        [sys.executable, "-m", "fedps.cli", "client", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_client_that_trusts_another_ca_exits_with_one_line(
    tls_shard: TlsShard, pki: Pki, tmp_path: Path
) -> None:
    # Prepare: client-0's certificates from another deployment's CA, its coordinator's address
    # served with ours
    theirs = pki.directory.parent / "theirs"
    config = tmp_path / "client.toml"
    config.write_text(
        f'[tls]\ndirectory = "{theirs}"\n'
        f'[cluster]\ncoordinator = "{tls_shard.address}"\nstate_dir = "{tmp_path / "state"}"\n'
    )

    # Execute
    result = _run_client(config)

    # Assert: exit 2, the last line names the CA file it trusts (no retrying forever)
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("fedps: error: register")
    assert "not issued by the CA this party trusts" in last and str(theirs / "ca.crt") in last


def test_a_client_whose_certificate_another_ca_issued_exits_with_one_line(
    tls_shard: TlsShard, pki: Pki, tmp_path: Path
) -> None:
    # Prepare: client-0 trusts our CA, but its own certificate and key are another CA's (every
    # server would close the handshake, which the client sees only as "Socket closed")
    certs = tmp_path / "certs"
    certs.mkdir(mode=0o700)
    (certs / "ca.crt").write_bytes(pki.client.ca_cert)
    (certs / "client-0.crt").write_bytes(pki.foreign_client.cert)
    (certs / "client-0.key").write_bytes(pki.foreign_client.key)
    (certs / "client-0.key").chmod(0o600)
    config = tmp_path / "client.toml"
    config.write_text(
        f'[tls]\ndirectory = "{certs}"\n'
        f'[cluster]\ncoordinator = "{tls_shard.address}"\nstate_dir = "{tmp_path / "state"}"\n'
    )

    # Execute
    result = _run_client(config)

    # Assert: exit 2 before any connection, one line naming its certificate and the CA
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("fedps: error: TLS certificate ")
    assert f"{certs / 'client-0.crt'} was not issued by the CA in {certs / 'ca.crt'}" in line
