"""Tests for the deployment CA and its certificates (crypto/tls.py) and ``fedps certs``."""

from __future__ import annotations

import datetime
import ipaddress
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from typer.testing import CliRunner

from crypto.enrolment import ENROLMENT_KEY_FILE, load_enrolment_key, read_token, verify_token
from crypto.tls import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    TlsIdentity,
    TlsMaterial,
    configure_tls,
    issue_certificate,
    make_ca,
    thread_tls,
    tls_identity,
)
from fedps.cli import app
from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.provisioning import issue_cluster_certificates, provision_cluster


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _san(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _eku(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_make_ca_is_a_private_self_signed_ca(tmp_path: Path, loose_umask: None) -> None:
    # Execute
    paths = make_ca(tmp_path / "certs")

    # Assert
    assert paths.cert == tmp_path / "certs" / CA_CERT_FILE
    assert paths.key == tmp_path / "certs" / CA_KEY_FILE
    assert _mode(paths.key) == 0o600
    ca = _cert(paths.cert)
    assert ca.subject == ca.issuer
    ca.verify_directly_issued_by(ca)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert 365 <= lifetime.days <= 366


def test_make_ca_refuses_to_replace_a_ca(tmp_path: Path) -> None:
    make_ca(tmp_path)
    before = (tmp_path / CA_KEY_FILE).read_bytes()

    with pytest.raises(FileExistsError):
        make_ca(tmp_path)
    assert (tmp_path / CA_KEY_FILE).read_bytes() == before


def test_issue_server_certificate(tmp_path: Path, loose_umask: None) -> None:
    # Prepare
    make_ca(tmp_path / "ca")

    # Execute
    paths = issue_certificate(
        tmp_path / "ca",
        "shard-0",
        hosts=["10.1.2.3", "ps.example.org"],
        out_dir=tmp_path / "out",
        client=True,
        server=True,
    )

    # Assert: key 0600, signed by the CA, SAN has the hosts plus loopback, both usages.
    assert paths.key == tmp_path / "out" / "shard-0.key"
    assert _mode(paths.key) == 0o600
    cert = _cert(paths.cert)
    cert.verify_directly_issued_by(_cert(tmp_path / "ca" / CA_CERT_FILE))
    san = _san(cert)
    ips = san.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("127.0.0.1") in ips
    assert ipaddress.ip_address("10.1.2.3") in ips
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "ps.example.org"}
    assert _eku(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_issue_client_certificate_has_client_usage_only(tmp_path: Path) -> None:
    make_ca(tmp_path)

    paths = issue_certificate(tmp_path, "client-3", hosts=[], client=True, server=False)

    cert = _cert(paths.cert)
    assert _eku(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert ipaddress.ip_address("127.0.0.1") in _san(cert).get_values_for_type(x509.IPAddress)


def test_certificate_from_another_ca_does_not_verify(tmp_path: Path) -> None:
    make_ca(tmp_path / "a")
    make_ca(tmp_path / "b")
    paths = issue_certificate(tmp_path / "a", "keyholder", hosts=[], client=True, server=True)

    with pytest.raises((ValueError, TypeError)):
        _cert(paths.cert).verify_directly_issued_by(_cert(tmp_path / "b" / CA_CERT_FILE))


def test_identity_load_and_repr_hides_the_key(tmp_path: Path) -> None:
    make_ca(tmp_path)
    issue_certificate(tmp_path, "coordinator", hosts=[], client=True, server=True)

    identity = TlsIdentity.load(tmp_path, "coordinator")

    assert identity.ca_cert == (tmp_path / CA_CERT_FILE).read_bytes()
    assert identity.cert == (tmp_path / "coordinator.crt").read_bytes()
    assert identity.key == (tmp_path / "coordinator.key").read_bytes()
    assert b"PRIVATE KEY" in identity.key
    assert "PRIVATE" not in repr(identity)


def test_thread_identity_overrides_the_process_identity_in_its_thread_only(
    tmp_path: Path,
) -> None:
    # Prepare: the process presents one certificate, a thread another
    make_ca(tmp_path)
    for name in ("client-0", "client-1"):
        issue_certificate(tmp_path, name, hosts=[], client=True, server=False)
    process, own = TlsIdentity.load(tmp_path, "client-0"), TlsIdentity.load(tmp_path, "client-1")
    seen: dict[str, TlsMaterial | None] = {}

    def other_thread() -> None:
        seen["other"] = tls_identity()

    configure_tls(process)
    try:
        # Execute
        with thread_tls(own):
            seen["inside"] = tls_identity()
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        seen["after"] = tls_identity()
    finally:
        configure_tls(None)

    # Assert
    assert seen == {"inside": own, "other": process, "after": process}


def test_identity_load_missing_file_names_it(tmp_path: Path) -> None:
    make_ca(tmp_path)

    with pytest.raises(ConfigError) as excinfo:
        TlsIdentity.load(tmp_path, "shard-1")

    message = str(excinfo.value)
    assert str(tmp_path / "shard-1.crt") in message
    assert "fedps certs" in message


def test_identity_load_refuses_a_readable_key(tmp_path: Path) -> None:
    make_ca(tmp_path)
    paths = issue_certificate(tmp_path, "keyholder", hosts=[], client=True, server=True)
    paths.key.chmod(0o644)

    with pytest.raises(ConfigError, match="chmod 600"):
        TlsIdentity.load(tmp_path, "keyholder")


def test_identity_load_refuses_its_own_certificate_from_another_ca(tmp_path: Path) -> None:
    # Prepare: our CA beside a certificate another CA issued under the same name
    make_ca(tmp_path / "ours")
    make_ca(tmp_path / "theirs")
    theirs = issue_certificate(tmp_path / "theirs", "client-0", hosts=[], client=True, server=False)
    for path in (theirs.cert, theirs.key):
        (tmp_path / "ours" / path.name).write_bytes(path.read_bytes())
        (tmp_path / "ours" / path.name).chmod(0o600)

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        TlsIdentity.load(tmp_path / "ours", "client-0")

    # Assert: the file to replace, and the CA its peers trust
    message = str(excinfo.value)
    assert f"{tmp_path / 'ours' / 'client-0.crt'} was not issued by the CA in " in message
    assert str(tmp_path / "ours" / CA_CERT_FILE) in message


def test_identity_load_refuses_its_own_expired_certificate(tmp_path: Path) -> None:
    # Prepare: a certificate our CA signed, valid until yesterday
    make_ca(tmp_path)
    paths = issue_certificate(tmp_path, "shard-0", hosts=[], client=True, server=True)
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    issued = _cert(paths.cert)
    now = datetime.datetime.now(datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(issued.subject)
        .issuer_name(issued.issuer)
        .public_key(issued.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    paths.cert.write_bytes(expired.public_bytes(serialization.Encoding.PEM))

    # Execute
    with pytest.raises(ConfigError) as excinfo:
        TlsIdentity.load(tmp_path, "shard-0")

    # Assert
    message = str(excinfo.value)
    assert str(paths.cert) in message and "not now" in message and "fedps certs" in message


def test_cluster_certificates_cover_every_party(tmp_path: Path) -> None:
    config = load_config(
        None,
        cluster={
            "keyholder": "10.0.0.1:7100",
            "coordinator": "coord.internal:7000",
            "shards": ["10.0.0.2:7201", "0.0.0.0:7202"],
        },
        training={"clients": 3},
    )

    written = issue_cluster_certificates(config, tmp_path)

    servers = {"ca", "keyholder", "coordinator", "shard-0", "shard-1"}
    assert {p.cert.stem for p in written} == {
        *servers,
        "client-0",
        "client-1",
        "client-2",
        "operator",
    }
    kh = _san(_cert(tmp_path / "keyholder.crt"))
    assert ipaddress.ip_address("10.0.0.1") in kh.get_values_for_type(x509.IPAddress)
    coord = _san(_cert(tmp_path / "coordinator.crt"))
    assert "coord.internal" in coord.get_values_for_type(x509.DNSName)
    wildcard = _san(_cert(tmp_path / "shard-1.crt")).get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("0.0.0.0") not in wildcard
    assert _eku(_cert(tmp_path / "client-2.crt")) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert all(_mode(p.key) == 0o600 for p in written)

    # A second run reuses the CA, so certificates already handed out stay valid.
    ca_before = (tmp_path / CA_CERT_FILE).read_bytes()
    issue_cluster_certificates(config, tmp_path)
    assert (tmp_path / CA_CERT_FILE).read_bytes() == ca_before


def test_cluster_certificates_name_the_dial_hosts_not_the_listen_ones(tmp_path: Path) -> None:
    # Prepare: containers dialed by service name, each listening on every interface
    config = load_config(
        None,
        cluster={
            "keyholder": "keyholder:7100",
            "coordinator": "coordinator:7000",
            "shards": ["shard-0:7201", "shard-1:7202"],
            "listen": {
                "keyholder": "0.0.0.0:7100",
                "coordinator": "[::]:7000",
                "shards": ["0.0.0.0:7201", "10.9.9.9:7202"],
            },
        },
    )

    # Execute
    issue_cluster_certificates(config, tmp_path)

    # Assert: each server's DNS name (what peers verify), never a bound address
    for name in ("keyholder", "coordinator", "shard-0", "shard-1"):
        san = _san(_cert(tmp_path / f"{name}.crt"))
        assert name in san.get_values_for_type(x509.DNSName)
        ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        assert ips == {"127.0.0.1"}, name


def test_tls_config_rejects_enabled_and_insecure() -> None:
    with pytest.raises(ConfigError, match="tls"):
        load_config(None, tls={"enabled": True, "insecure": True})


def test_certs_command_writes_every_identity(tmp_path: Path) -> None:
    # Prepare
    config = tmp_path / "cluster.toml"
    config.write_text('[cluster]\nshards = ["127.0.0.1:7301"]\n[training]\nclients = 2\n')

    # Execute
    result = CliRunner().invoke(
        app, ["certs", "--config", str(config), "--out", str(tmp_path / "certs")]
    )

    # Assert: certificates, the enrolment key and a token per client, all private
    assert result.exit_code == 0, result.output
    certs = tmp_path / "certs"
    for name in ["ca", "keyholder", "coordinator", "shard-0", "client-0", "client-1"]:
        assert (certs / f"{name}.crt").exists()
        assert str(certs / f"{name}.crt") in result.output
    key = load_enrolment_key(certs)
    assert _mode(certs / ENROLMENT_KEY_FILE) == 0o600
    for i in range(2):
        token = read_token(certs, f"client-{i}")
        assert token is not None and verify_token(key, token) == f"client-{i}"
        assert _mode(certs / f"client-{i}.token") == 0o600
        assert token.rpartition(".")[2] not in result.output  # no secret printed
    assert not (certs / "client-2.token").exists()
    assert "BEGIN" not in result.output  # no key material printed


def test_provision_creates_what_is_missing_and_keeps_what_exists(tmp_path: Path) -> None:
    # Prepare: the default configuration (mutual TLS) with its own certificate directory
    config = load_config(None, tls={"directory": str(tmp_path / "certs")})

    # Execute: first start, then a second start
    first = provision_cluster(config)
    ca = (tmp_path / "certs" / CA_CERT_FILE).read_bytes()
    token = read_token(tmp_path / "certs", "client-3")
    second = provision_cluster(config)

    # Assert: every party's certificate and every client's token once; nothing replaced
    names = {p.name for p in first}
    assert {"ca.crt", "operator.crt", "shard-1.key", "client-3.token", ENROLMENT_KEY_FILE} <= names
    assert second == []
    assert (tmp_path / "certs" / CA_CERT_FILE).read_bytes() == ca
    assert read_token(tmp_path / "certs", "client-3") == token


def test_provision_without_tls_makes_only_the_tokens(tmp_path: Path) -> None:
    config = load_config(None, tls={"insecure": True, "directory": str(tmp_path / "certs")})

    written = provision_cluster(config)

    assert not (tmp_path / "certs" / CA_CERT_FILE).exists()
    assert {p.name for p in written} == {
        ENROLMENT_KEY_FILE,
        *(f"client-{i}.token" for i in range(config.training.clients)),
    }


def test_role_without_its_certificate_is_one_clear_error(tmp_path: Path) -> None:
    # Prepare: a CA, but no certificate for client-7 (one of 8 clients).
    make_ca(tmp_path / "certs")
    config = tmp_path / "tls.toml"
    config.write_text(  # TLS: the default
        f'[tls]\ndirectory = "{tmp_path / "certs"}"\n[training]\nclients = 8\n'
    )

    # Execute
    result = subprocess.run(
        [sys.executable, "-m", "fedps.cli", "client", "--config", str(config), "--index", "7"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Assert
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fedps: error:")
    assert str(tmp_path / "certs" / "client-7.crt") in lines[0]
    assert "fedps certs" in lines[0]
