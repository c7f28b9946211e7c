"""Certificates for mutual TLS between fedps parties: one small CA per deployment.

:func:`make_ca` creates the CA (ECDSA P-256, self-signed, valid one year) and
:func:`issue_certificate` signs one identity with it: ``NAME.key`` (written with mode 0600)
and ``NAME.crt`` carrying a SubjectAltName for every host the identity serves on (IP addresses
and DNS names; ``127.0.0.1`` and ``localhost`` always included) and the ExtendedKeyUsage of
its role. :class:`TlsIdentity` is what a process loads to speak TLS: the CA certificate it
trusts plus its own certificate and key. ``fedps certs`` writes all of them for a cluster,
with the enrolment key and client tokens of :mod:`crypto.enrolment`; ``fedps up`` and
``fedps demo`` create them on first start (:func:`fedps.provisioning.provision_cluster`).

The process's identity is process-wide: :func:`configure_tls` sets it (usually through
:func:`fedps.provisioning.setup_tls`, from the ``[tls]`` section) before any channel or server
exists, and :mod:`fedps.rpc.transport` reads it (:func:`tls_identity`) for every channel and port.

Key material is never logged or put into an error message; only file names are.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import stat
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from crypto.files import private_directory, write_atomic, write_private
from fedps.errors import ConfigError

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "DEFAULT_HOSTS",
    "OPERATOR_NAME",
    "CertPaths",
    "TlsIdentity",
    "TlsMaterial",
    "configure_tls",
    "issue_certificate",
    "issue_certificates",
    "make_ca",
    "thread_tls",
    "tls_identity",
]

#: The CA's certificate and key inside a certificate directory.
CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
#: Hosts every certificate names, so that loopback connections always verify.
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
#: Client identity of operator tools (``fedps status``, the demo's watcher).
OPERATOR_NAME = "operator"
#: Validity of the CA and of every certificate it issues.
VALIDITY = datetime.timedelta(days=365)
# Tolerate this much clock skew between the machine issuing and the machines verifying.
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class CertPaths:
    """Where a certificate and its private key were written."""

    cert: Path
    key: Path


class TlsMaterial(Protocol):
    """What mutual TLS needs: the CA certificate, our certificate and its key (PEM)."""

    @property
    def ca_cert(self) -> bytes:
        """The CA certificate (PEM)."""

    @property
    def cert(self) -> bytes:
        """Our certificate (PEM)."""

    @property
    def key(self) -> bytes:
        """Our certificate's private key (PEM)."""


@dataclass(frozen=True)
class TlsIdentity:
    """What one process needs for mutual TLS: the CA to trust, its certificate and key (PEM).

    ``repr`` leaves the key out, so an identity can be logged or shown in a traceback safely.
    """

    ca_cert: bytes
    cert: bytes
    key: bytes = field(repr=False)
    #: the file ``ca_cert`` was read from ("" when it was not read from a file), for errors
    ca_path: str = field(default="", compare=False)

    @classmethod
    def load(cls, directory: Path, name: str) -> TlsIdentity:
        """Load ``ca.crt``, ``NAME.crt`` and ``NAME.key`` from ``directory``.

        Raises
        ------
        ConfigError
            A file is missing or unreadable (naming it and suggesting ``fedps certs``), or the
            key file is readable by group or others.
        """
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"invalid TLS identity name {name!r}")
        ca_path = directory / CA_CERT_FILE
        cert_path = directory / f"{name}.crt"
        key_path = directory / f"{name}.key"
        ca_cert, cert = _read(ca_path), _read(cert_path)
        mode = stat.S_IMODE(key_path.stat().st_mode) if key_path.exists() else 0
        if mode & 0o077:
            raise ConfigError(
                f"TLS key {key_path} is readable by group or others (mode {mode:o}); chmod 600 it"
            )
        _check_own_certificate(ca_path, ca_cert, cert_path, cert)
        return cls(ca_cert=ca_cert, cert=cert, key=_read(key_path), ca_path=str(ca_path))


def _check_own_certificate(ca_path: Path, ca_pem: bytes, cert_path: Path, cert_pem: bytes) -> None:
    """Refuse a party's own certificate that its peers would refuse.

    Its peers trust the CA in ``ca_path`` (the deployment's): a certificate another CA issued,
    or one outside its validity, is refused in every handshake, and the party sees only the
    connection closed. Said here, once, naming the file.

    Raises
    ------
    ConfigError
        A file is not a PEM certificate, ``cert_pem`` was not issued by ``ca_pem``'s CA, or it
        is not valid now.
    """
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        own = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError(
            f"TLS file {ca_path} or {cert_path} is not a PEM certificate; create the "
            "certificates with `fedps certs`"
        ) from None
    try:
        own.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(
            f"TLS certificate {cert_path} was not issued by the CA in {ca_path}, which every "
            "peer of this deployment trusts (they would refuse it); use the certificate "
            "`fedps certs` issued with that CA"
        ) from None
    now = datetime.datetime.now(datetime.UTC)
    if not own.not_valid_before_utc <= now <= own.not_valid_after_utc:
        raise ConfigError(
            f"TLS certificate {cert_path} is valid from {own.not_valid_before_utc:%Y-%m-%d %H:%M} "
            f"to {own.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now; issue a new one with "
            "`fedps certs` (its CA is reused)"
        )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates only; a party's key signs TLS handshakes only."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(directory: Path, *, common_name: str = "fedps deployment CA") -> CertPaths:
    """Create a new CA in ``directory`` (``ca.crt``, and ``ca.key`` with mode 0600).

    The CA is self-signed, may sign only end-entity certificates (path length 0) and is valid
    for one year. A random suffix in its name tells deployments' CAs apart.

    Raises
    ------
    FileExistsError
        ``directory`` already holds a CA key: replacing it would invalidate every certificate
        it issued. Remove the directory to start over.
    """
    private_directory(directory)
    paths = CertPaths(directory / CA_CERT_FILE, directory / CA_KEY_FILE)
    if paths.key.exists():
        raise FileExistsError(f"{paths.key} exists; remove {directory} to create a new CA")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedps"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} {secrets.token_hex(4)}"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage(ca=True),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(paths.key, _key_pem(key))
    write_atomic(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return paths


def issue_certificate(
    ca_dir: Path,
    name: str,
    *,
    hosts: list[str],
    out_dir: Path | None = None,
    client: bool,
    server: bool,
) -> CertPaths:
    """Sign a new key for identity ``name`` with the CA in ``ca_dir``.

    Parameters
    ----------
    ca_dir
        Directory holding ``ca.crt`` and ``ca.key`` (from :func:`make_ca`).
    name
        The identity (``keyholder``, ``shard-0``, ``client-3``...): the certificate's common
        name and the stem of the files written.
    hosts
        Host names and IP addresses the identity is reached at; they go into the
        SubjectAltName together with ``127.0.0.1`` and ``localhost``.
    out_dir
        Where ``NAME.crt`` and ``NAME.key`` (mode 0600) go; default ``ca_dir``.
    client, server
        ExtendedKeyUsage: TLS client authentication, TLS server authentication (or both).
    """
    if not (client or server):
        raise ValueError("a certificate needs client or server usage (or both)")
    if not name or "/" in name or name.startswith(".") or name == "ca":
        raise ValueError(f"invalid identity name {name!r}")
    out_dir = ca_dir if out_dir is None else out_dir
    ca_key = serialization.load_pem_private_key(_read(ca_dir / CA_KEY_FILE), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_dir / CA_KEY_FILE} is not an ECDSA key made by fedps certs")
    ca_cert = x509.load_pem_x509_certificate(_read(ca_dir / CA_CERT_FILE))
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    now = datetime.datetime.now(datetime.UTC)
    not_after = min(now + VALIDITY, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedps"),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(ca=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    private_directory(out_dir)
    paths = CertPaths(out_dir / f"{name}.crt", out_dir / f"{name}.key")
    write_private(paths.key, _key_pem(key))
    write_atomic(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return paths


def issue_certificates(
    out_dir: Path, *, servers: Mapping[str, Sequence[str]], clients: Sequence[str]
) -> list[CertPaths]:
    """The CA (reused if ``out_dir`` has one) and one certificate per identity, all in ``out_dir``.

    Parameters
    ----------
    out_dir
        Where the CA is (or is created, :func:`make_ca`) and the certificates go.
    servers
        Identity -> the hosts it serves on: server and client usage (servers also call each
        other), those hosts in the SubjectAltName.
    clients
        Identities with client usage only.

    Returns
    -------
    list[CertPaths]
        The CA's paths first, then one per identity.
    """
    if (out_dir / CA_KEY_FILE).exists():
        written = [CertPaths(out_dir / CA_CERT_FILE, out_dir / CA_KEY_FILE)]
        _read(out_dir / CA_CERT_FILE)  # a CA key without its certificate: say which is missing
    else:
        written = [make_ca(out_dir)]
    for name, hosts in servers.items():
        written.append(
            issue_certificate(out_dir, name, hosts=list(hosts), client=True, server=True)
        )
    for name in clients:
        written.append(issue_certificate(out_dir, name, hosts=[], client=True, server=False))
    return written


def _san(hosts: list[str]) -> list[x509.GeneralName]:
    """IP addresses as iPAddress entries, everything else as dNSName; no duplicates."""
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in [*hosts, *DEFAULT_HOSTS]:
        host = raw.strip().removeprefix("[").removesuffix("]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"TLS file {path} not found; create the certificates with `fedps certs`"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from None


# The process-wide TLS identity (None: plaintext), set by configure_tls before any connection.
_tls: TlsMaterial | None = None
_tls_lock = threading.Lock()


def configure_tls(identity: TlsMaterial | None) -> None:
    """Use ``identity`` for mutual TLS on every channel and server created from now on.

    :mod:`fedps.rpc.transport` reads it; ``None`` goes back to plaintext.

    Call it before creating channels or servers: existing ones keep the credentials they were
    created with.
    """
    global _tls
    with _tls_lock:
        _tls = identity


# An identity for the channels one thread creates, over the process's (see thread_tls).
_thread_tls = threading.local()


@contextmanager
def thread_tls(identity: TlsMaterial) -> Iterator[None]:
    """Present ``identity`` on the channels this thread creates inside the block.

    Over the process's identity (:func:`configure_tls`), for this thread only: a process that
    hosts many clients (the replaying clients of ``fedps bench --scale``) runs each on its
    own thread under its own certificate, as if each were a process of its own. Channels
    keep the credentials they were created with, so a client's channels must be created
    inside its block; a channel another thread creates gets the process's identity.
    """
    before: TlsMaterial | None = getattr(_thread_tls, "identity", None)
    _thread_tls.identity = identity
    try:
        yield
    finally:
        _thread_tls.identity = before


def tls_identity() -> TlsMaterial | None:
    """The calling thread's identity (:func:`thread_tls`), else the process's, else ``None``.

    The process's is the one configured with :func:`configure_tls`.
    """
    own: TlsMaterial | None = getattr(_thread_tls, "identity", None)
    return own if own is not None else _tls
