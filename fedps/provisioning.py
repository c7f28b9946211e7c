"""A cluster's TLS and enrolment material from its configuration, and this process's TLS.

``crypto/`` knows certificates, tokens and the process-wide identity but nothing of the
configuration; this module reads the ``[cluster]``, ``[training]`` and ``[tls]`` sections and
asks ``crypto/`` for what they describe: the certificates of every party
(:func:`issue_cluster_certificates`), everything a one-machine cluster is missing
(:func:`provision_cluster`), and this process's identity (:func:`setup_tls`), which every role
sets up before it creates a channel or a server.
"""

from __future__ import annotations

import logging
from pathlib import Path

from crypto.enrolment import ENROLMENT_KEY_FILE, issue_tokens
from crypto.tls import (
    CA_KEY_FILE,
    OPERATOR_NAME,
    CertPaths,
    TlsIdentity,
    configure_tls,
    issue_certificates,
    tls_identity,
)
from fedps.config import FedPSConfig, TlsConfig

__all__ = [
    "client_identities",
    "issue_cluster_certificates",
    "provision_cluster",
    "reset_tls",
    "setup_tls",
]

_log = logging.getLogger("fedps")


def issue_cluster_certificates(config: FedPSConfig, out_dir: Path) -> list[CertPaths]:
    """The CA (reused if ``out_dir`` has one) and one certificate per party of ``config``.

    Key holder, coordinator, shards and key-holder parties (``party-1``...) get server and
    client usage (they also call each other), with the host of their ``[cluster]`` address,
    the one peers dial and verify (an IP address or a DNS name such as a compose service's),
    in the SubjectAltName; the
    ``[cluster.listen]`` addresses they bind are not named there. Each of the
    ``training.clients`` clients (``client-0``...) and the operator get client usage only
    (:func:`crypto.tls.issue_certificates`).
    """
    cluster = config.cluster
    addresses = {
        "keyholder": cluster.keyholder,
        "coordinator": cluster.coordinator,
        **dict(zip(cluster.shard_ids, cluster.shards, strict=True)),
        **{f"party-{i}": address for i, address in enumerate(cluster.parties, start=1)},
    }
    servers = {name: [host] if (host := _host_of(a)) else [] for name, a in addresses.items()}
    return issue_certificates(
        out_dir, servers=servers, clients=[*client_identities(config), OPERATOR_NAME]
    )


def client_identities(config: FedPSConfig) -> list[str]:
    """The client identities an operator provisions: ``client-0`` ... ``client-{N-1}``.

    For ``training.clients`` = N (certificate common names and token names).
    """
    return [f"client-{i}" for i in range(config.training.clients)]


def provision_cluster(config: FedPSConfig) -> list[Path]:
    """Create what a one-machine cluster needs in ``tls.directory`` if there is none.

    With TLS on and no CA there yet: the CA and every party's certificate
    (:func:`issue_cluster_certificates`). With no enrolment key there yet: the key and every
    client's token (:func:`crypto.enrolment.issue_tokens`). Nothing that exists is replaced.
    ``fedps up`` and ``fedps demo`` call this on start.

    Returns
    -------
    list[Path]
        The files written (empty when nothing was missing).
    """
    directory = config.tls.directory
    written: list[Path] = []
    if config.tls.enabled and not (directory / CA_KEY_FILE).exists():
        for paths in issue_cluster_certificates(config, directory):
            written += [paths.cert, paths.key]
    if not (directory / ENROLMENT_KEY_FILE).exists():
        written += issue_tokens(directory, client_identities(config))
        written.append(directory / ENROLMENT_KEY_FILE)
    return written


def _host_of(address: str) -> str:
    """The host of ``host:port``; empty for wildcard binds, which no peer dials."""
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return "" if host in ("", "0.0.0.0", "::") else host


_warned_insecure = False


def setup_tls(tls: TlsConfig, name: str) -> None:
    """Configure this process's TLS from the ``[tls]`` section, before anything connects.

    By default (``tls.enabled``) load identity ``tls.name`` (default ``name``, the role's name
    such as ``shard-0`` or ``client-3``) from ``tls.directory`` and configure it process-wide
    (:func:`crypto.tls.configure_tls`). With ``tls.insecure`` (``--insecure``) traffic
    stays plaintext, and the process says so with a warning when it starts.

    Raises
    ------
    ConfigError
        A certificate or key file is missing (the message names it and suggests
        ``fedps certs``) or the key is readable by others.
    """
    global _warned_insecure
    if tls.enabled:
        identity = TlsIdentity.load(tls.directory, tls.name or name)
        if identity == tls_identity():
            return  # already set up (the CLI and serve_forever both call this)
        configure_tls(identity)
        _log.info("mutual TLS on as %r (certificates in %s)", tls.name or name, tls.directory)
        return
    configure_tls(None)
    if _warned_insecure:
        return  # once per process: the CLI and serve_forever both call this
    _warned_insecure = True
    _log.warning(
        "TLS is off (--insecure): gRPC traffic of %s is unencrypted and unauthenticated, and "
        "clients are admitted by enrolment token alone. Drop --insecure and tls.insecure to "
        "use mutual TLS (certificates from `fedps certs`)",
        name,
    )


def reset_tls() -> None:
    """Plaintext again, and forget the insecure-mode warning (for tests)."""
    global _warned_insecure
    configure_tls(None)
    _warned_insecure = False
